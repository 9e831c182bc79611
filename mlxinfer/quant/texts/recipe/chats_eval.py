"""Conversations of the evaluation corpus, written for mlxinfer (MIT)."""

from chat_helpers import A, S, U, call, result

CHATS = [
    [
        S("You are a concise assistant. Answer in plain English."),
        U("Why does bread dough need to rest before it goes into the oven?"),
        A(
            "Resting, or proofing, gives the yeast time to ferment. It eats sugars released from the "
            "starch and gives off carbon dioxide, and the gluten network traps that gas, so the dough "
            "swells. A rested dough also relaxes: the gluten strands stop fighting back, which makes "
            "shaping easier and lets the loaf expand evenly instead of tearing at the weakest point.\n\n"
            "If you bake too early, the crumb is dense and the crust often bursts open on one side. If "
            "you wait too long, the gas cells grow thin walls and collapse, and the loaf spreads flat. "
            "A simple test: press the dough gently with a floured finger. If the dent springs back "
            "slowly and only partly, it is ready."
        ),
        U("And what does the salt do?"),
        A(
            "Salt seasons the bread, but it also tightens the gluten and slows fermentation a little. "
            "Without it the dough rises quickly, feels slack and sticky, and the bread tastes flat. "
            "About two percent of the flour's weight is typical: 10 grams of salt for 500 grams of flour."
        ),
    ],
    [
        U(
            "Écris-moi un court paragraphe qui explique ce qu'est une fonction récursive, avec un exemple."
        ),
        A(
            "Une fonction récursive est une fonction qui s'appelle elle-même pour résoudre une version "
            "plus petite du même problème. Elle a toujours deux parties : un cas de base, qui s'arrête "
            "sans nouvel appel, et un cas récursif, qui réduit le problème avant de se rappeler.\n\n"
            "Exemple en Python, la factorielle :\n\n```python\ndef factorielle(n):\n    if n <= 1:\n"
            "        return 1  # cas de base\n    return n * factorielle(n - 1)  # cas récursif\n```\n\n"
            "Ainsi, `factorielle(4)` calcule 4 × 3 × 2 × 1 = 24. Sans cas de base, la fonction "
            "s'appellerait indéfiniment jusqu'à dépasser la profondeur de pile autorisée."
        ),
        U("Et quelle est la différence avec une boucle ?"),
        A(
            "Le résultat est le même, mais la mémoire diffère : chaque appel récursif ajoute un cadre "
            "sur la pile, alors qu'une boucle réutilise les mêmes variables. Pour de grandes valeurs, "
            "la version itérative est donc plus sûre en Python, qui n'optimise pas les appels terminaux."
        ),
    ],
    [
        S("You are a helpful assistant with access to tools. Call a tool when it helps."),
        U("What's the weather like in Lisbon right now? Celsius please."),
        call("call_w1", "get_weather", {"city": "Lisbon, Portugal", "unit": "celsius"}),
        result(
            "call_w1",
            "get_weather",
            {"city": "Lisbon", "temperature": 19.5, "wind_kmh": 14, "sky": "partly cloudy"},
        ),
        A(
            "It is 19.5 °C in Lisbon, partly cloudy, with a light wind of 14 km/h. A light jacket will do."
        ),
        U("How much is 250 euros in US dollars?"),
        call("call_c1", "convert_currency", {"amount": 250, "from": "EUR", "to": "USD"}),
        result(
            "call_c1", "convert_currency", {"amount": 271.35, "currency": "USD", "rate": 1.0854}
        ),
        A("250 EUR is about 271.35 USD at today's rate of 1.0854."),
    ],
    [
        U("Wie viele Sekunden hat ein Schaltjahr? Bitte mit Rechenweg."),
        A(
            "Ein Schaltjahr hat 366 Tage.\n\n- Stunden: 366 × 24 = 8 784\n- Minuten: 8 784 × 60 = "
            "527 040\n- Sekunden: 527 040 × 60 = 31 622 400\n\nEin Schaltjahr hat also 31 622 400 "
            "Sekunden, genau 86 400 mehr als ein gewöhnliches Jahr mit 31 536 000 Sekunden."
        ),
    ],
    [
        S("You are a senior Python reviewer. Be specific."),
        U(
            "Can you review this?\n\n```python\ndef average(xs):\n    total = 0\n    for x in xs:\n"
            "        total += x\n    return total / len(xs)\n```"
        ),
        A(
            "Three points:\n\n1. An empty list raises `ZeroDivisionError`. Decide what it should mean: "
            "raise a clearer `ValueError`, or return `None`.\n2. The loop is what `sum()` already does, "
            "faster and clearer.\n3. If `xs` is a generator, `len(xs)` fails; accept any iterable by "
            "counting while you add.\n\n```python\ndef average(xs):\n    total, count = 0.0, 0\n"
            "    for x in xs:\n        total += x\n        count += 1\n    if count == 0:\n"
            '        raise ValueError("average of an empty sequence")\n    return total / count\n```\n\n'
            "For floats that differ wildly in magnitude, `math.fsum` avoids losing small terms; "
            "`statistics.fmean` does both jobs in one call."
        ),
    ],
    [
        U("用三句话解释一下什么是光合作用。"),
        A(
            "光合作用是植物、藻类和某些细菌利用光能把二氧化碳和水转化为葡萄糖并释放氧气的过程。"
            "它主要发生在叶绿体中，叶绿素吸收阳光，把光能转化为化学能。"
            "地球上几乎所有生命所需的能量和大气中的氧气，最终都来自光合作用。"
        ),
        U("那么呼吸作用和它有什么关系？"),
        A(
            "呼吸作用几乎是光合作用的逆过程：细胞分解葡萄糖，消耗氧气，释放二氧化碳、水和能量。"
            "植物白天同时进行两者，而夜里只进行呼吸作用。"
        ),
    ],
    [
        S("You are a travel assistant. Use the tools to answer."),
        U("Find me a flight from Frankfurt to Madrid on the 14th of March 2025 for two people."),
        call(
            "call_f1",
            "search_flights",
            {"origin": "FRA", "destination": "MAD", "date": "2025-03-14", "passengers": 2},
        ),
        result(
            "call_f1",
            "search_flights",
            {
                "flights": [
                    {"number": "LH1114", "departs": "07:15", "arrives": "09:55", "price_eur": 188},
                    {"number": "IB3401", "departs": "12:40", "arrives": "15:20", "price_eur": 156},
                    {"number": "LH1122", "departs": "18:05", "arrives": "20:45", "price_eur": 212},
                ]
            },
        ),
        A(
            "Three direct flights on 14 March 2025, prices for both passengers together:\n\n"
            "| flight | departs | arrives | price |\n|---|---|---|---|\n| LH1114 | 07:15 | 09:55 | €188 |\n"
            "| IB3401 | 12:40 | 15:20 | €156 |\n| LH1122 | 18:05 | 20:45 | €212 |\n\n"
            "The Iberia flight at midday is the cheapest. Shall I put it in your calendar?"
        ),
        U("Yes, add the Iberia one, and invite maria@example.com."),
        call(
            "call_e1",
            "create_calendar_event",
            {
                "title": "Flight IB3401 FRA to MAD",
                "start": "2025-03-14T12:40:00+01:00",
                "duration_minutes": 160,
                "attendees": ["maria@example.com"],
            },
        ),
        result("call_e1", "create_calendar_event", {"status": "created", "event_id": "evt_58213"}),
        A(
            'Done: "Flight IB3401 FRA to MAD" is in your calendar on 14 March from 12:40, and Maria is invited.'
        ),
    ],
    [
        U("¿Cuál es la diferencia entre una lista y una tupla en Python?"),
        A(
            "La diferencia principal es la mutabilidad. Una lista (`[1, 2, 3]`) se puede modificar "
            "después de crearla: añadir, quitar o cambiar elementos. Una tupla (`(1, 2, 3)`) es "
            "inmutable: una vez creada, su contenido no cambia.\n\nDe ahí salen otras diferencias:\n\n"
            "- Una tupla de valores inmutables es *hashable*, así que puede ser clave de un diccionario "
            "o elemento de un conjunto; una lista no.\n- Las tuplas ocupan algo menos de memoria.\n"
            "- Por convención, las listas guardan elementos del mismo tipo y las tuplas agrupan campos "
            "distintos, como `(nombre, edad)`."
        ),
    ],
    [
        S("You are a data analyst with read-only access to the sales database."),
        U("Which three products sold the most units last month?"),
        call(
            "call_q1",
            "run_sql",
            {
                "query": "SELECT product, SUM(units) AS sold FROM sales WHERE month = '2024-11' GROUP BY product ORDER BY sold DESC",
                "limit": 3,
            },
        ),
        result(
            "call_q1",
            "run_sql",
            [
                {"product": "Desk lamp", "sold": 1240},
                {"product": "USB-C cable", "sold": 1175},
                {"product": "Notebook A5", "sold": 982},
            ],
        ),
        A(
            "In November 2024 the best sellers were the desk lamp (1,240 units), the USB-C cable "
            "(1,175) and the A5 notebook (982). Together they account for 3,397 units."
        ),
    ],
    [
        U("Объясни, пожалуйста, что такое двоичный поиск и какая у него сложность."),
        A(
            "Двоичный поиск ищет значение в отсортированном массиве. На каждом шаге он сравнивает "
            "искомое значение с элементом в середине текущего диапазона: если оно меньше, поиск "
            "продолжается в левой половине, если больше — в правой. Так диапазон каждый раз "
            "сокращается вдвое.\n\nПоэтому сложность — O(log n): для миллиона элементов хватает "
            "примерно двадцати сравнений. Главное условие — массив должен быть отсортирован."
        ),
    ],
    [
        U("日本語で、睡眠が記憶に与える影響を簡単に説明してください。"),
        A(
            "睡眠中、脳は日中に得た情報を整理し、長期記憶として定着させます。"
            "特に深いノンレム睡眠の間に、海馬に一時的に保存された記憶が大脳皮質へ移されると考えられています。"
            "睡眠不足になると新しいことを覚える力も、覚えたことを思い出す力も低下します。"
        ),
    ],
    [
        S("You are a coding assistant inside the user's editor. You may read files."),
        U("Why does my test in tests/test_parse.py fail?"),
        call("call_r1", "read_file", {"path": "tests/test_parse.py", "max_bytes": 4000}),
        result(
            "call_r1",
            "read_file",
            'from parse import parse_date\n\n\ndef test_parse_date():\n    assert parse_date("2024-02-30") is None\n',
        ),
        call("call_r2", "read_file", {"path": "parse.py"}),
        result(
            "call_r2",
            "read_file",
            "import datetime\n\n\ndef parse_date(text):\n    return datetime.date.fromisoformat(text)\n",
        ),
        A(
            "The test expects `parse_date` to return `None` for an impossible date, but the function "
            "passes the text straight to `date.fromisoformat`, which raises `ValueError` for "
            "30 February. Catch the error:\n\n```python\ndef parse_date(text):\n    try:\n"
            "        return datetime.date.fromisoformat(text)\n    except ValueError:\n"
            "        return None\n```"
        ),
    ],
    [
        U("Give me a regular expression that matches a time like 09:45 or 23:05, but not 24:00."),
        A(
            "`^([01]\\d|2[0-3]):[0-5]\\d$`\n\n- `[01]\\d` covers hours 00 to 19 and `2[0-3]` hours 20 to 23.\n"
            "- `[0-5]\\d` covers minutes 00 to 59.\n- The anchors stop it from matching inside a longer "
            "string such as `123:456`."
        ),
    ],
    [
        S("Answer with the tools available; report prices in the currency returned."),
        U("How is ACME trading today, and what's that in yen?"),
        call("call_s1", "get_stock_quote", {"symbol": "ACME"}),
        result(
            "call_s1",
            "get_stock_quote",
            {"symbol": "ACME", "price": 42.17, "currency": "USD", "change_pct": -1.8},
        ),
        call("call_s2", "convert_currency", {"amount": 42.17, "from": "USD", "to": "JPY"}),
        result(
            "call_s2", "convert_currency", {"amount": 6298.09, "currency": "JPY", "rate": 149.35}
        ),
        A("ACME trades at $42.17, down 1.8% today; that is about ¥6,298 per share."),
    ],
    [
        U('Translate "The meeting is moved to Thursday afternoon" into Italian and Korean.'),
        call(
            "call_t1",
            "translate_text",
            {"text": "The meeting is moved to Thursday afternoon", "target_language": "it"},
        ),
        result(
            "call_t1",
            "translate_text",
            {"translation": "La riunione è spostata a giovedì pomeriggio."},
        ),
        call(
            "call_t2",
            "translate_text",
            {"text": "The meeting is moved to Thursday afternoon", "target_language": "ko"},
        ),
        result("call_t2", "translate_text", {"translation": "회의가 목요일 오후로 옮겨졌습니다."}),
        A(
            "Italian: «La riunione è spostata a giovedì pomeriggio.»\nKorean: 회의가 목요일 오후로 옮겨졌습니다."
        ),
    ],
    [
        S("You are a patient maths tutor."),
        U("Solve 3x + 7 = 2x - 5 and check the answer."),
        A(
            "Subtract 2x from both sides: x + 7 = -5.\nSubtract 7 from both sides: x = -12.\n\n"
            "Check: the left side is 3(-12) + 7 = -36 + 7 = -29, the right side is 2(-12) - 5 = "
            "-24 - 5 = -29. Both sides agree, so x = -12."
        ),
        U("Now in LaTeX, please."),
        A(
            "$$\\begin{aligned}\n3x + 7 &= 2x - 5\\\\\nx + 7 &= -5\\\\\nx &= -12\n\\end{aligned}$$\n\n"
            "Check: $3(-12) + 7 = -29 = 2(-12) - 5$."
        ),
    ],
]
