"""Conversations of the calibration corpus, written for mlxinfer (MIT)."""

from chat_helpers import A, S, U, call, result

CHATS = [
    [
        S("You are a friendly cooking assistant."),
        U("I have eggs, spinach, feta and half an onion. What can I make in 20 minutes?"),
        call(
            "call_k1",
            "lookup_recipe",
            {"ingredients": ["eggs", "spinach", "feta", "onion"], "max_minutes": 20},
        ),
        result(
            "call_k1",
            "lookup_recipe",
            {
                "recipes": [
                    {"name": "Spinach and feta omelette", "minutes": 12, "servings": 1},
                    {"name": "Greek-style scrambled eggs", "minutes": 10, "servings": 2},
                ]
            },
        ),
        A(
            "A spinach and feta omelette takes about 12 minutes. Soften the chopped onion in a little "
            "oil, add the spinach until it wilts, pour in three beaten eggs, crumble the feta on top "
            "and fold once the edges set. Season with pepper rather than salt: the feta is salty enough."
        ),
    ],
    [
        U("What is the difference between a process and a thread?"),
        A(
            "A process is a running program with its own address space: its memory, open files and "
            "other resources belong to it alone, and the operating system keeps processes isolated "
            "from one another. A thread is a path of execution inside a process. All threads of a "
            "process share its memory, so they can exchange data cheaply, but they must coordinate "
            "with locks or other primitives to avoid corrupting shared state.\n\nCreating a thread is "
            "cheaper than creating a process, and switching between threads is faster. In exchange, a "
            "crash in one thread usually takes the whole process down, while a crashed process leaves "
            "the others running."
        ),
        U("So in Python, should I use threads or processes to speed up number crunching?"),
        A(
            "Processes, in most cases. CPython's global interpreter lock lets only one thread run "
            "Python bytecode at a time, so threads help with waiting (network, disk) but not with "
            "pure computation. `concurrent.futures.ProcessPoolExecutor` spreads work across cores; "
            "NumPy and similar libraries also release the lock inside their own loops."
        ),
    ],
    [
        U(
            "Peux-tu me dire combien de temps il faut pour aller de la gare de Lyon à la tour Eiffel à vélo ?"
        ),
        call(
            "call_g1",
            "get_route",
            {"from": "Gare de Lyon, Paris", "to": "Tour Eiffel, Paris", "mode": "cycling"},
        ),
        result("call_g1", "get_route", {"distance_km": 7.4, "minutes": 28, "mode": "cycling"}),
        A(
            "À vélo, il faut compter environ 28 minutes pour 7,4 km. Le trajet le long des quais de "
            "la Seine est le plus agréable et presque entièrement plat."
        ),
    ],
    [
        S("You are a shell expert. Prefer portable POSIX commands."),
        U("How do I find the ten largest files under the current directory?"),
        A(
            "```sh\nfind . -type f -exec du -k {} + | sort -rn | head -n 10\n```\n\n`du -k` prints each "
            "file's size in kilobytes, `sort -rn` orders the lines numerically from largest to "
            "smallest, and `head` keeps the first ten. With GNU tools, `du -ah . | sort -rh | head` "
            "gives human-readable sizes but also lists directories."
        ),
    ],
    [
        U("Erkläre mir bitte den Unterschied zwischen Wetter und Klima."),
        A(
            "Wetter beschreibt den Zustand der Atmosphäre an einem Ort zu einem bestimmten Zeitpunkt: "
            "Temperatur, Niederschlag, Wind und Bewölkung heute oder morgen. Klima ist dagegen die "
            "Statistik des Wetters über lange Zeiträume, meist über dreißig Jahre: Durchschnittswerte, "
            "Schwankungen und Extreme.\n\nEin kalter Tag im Juni widerlegt also keinen Klimawandel, "
            "genauso wenig wie ein heißer Tag ihn beweist. Aussagekräftig sind erst Trends über "
            "viele Jahre."
        ),
    ],
    [
        S("You are an operations assistant for a small online shop."),
        U("Do we still have the blue kettle, SKU KT-220-BL, in stock anywhere?"),
        call("call_i1", "query_inventory", {"sku": "KT-220-BL"}),
        result(
            "call_i1",
            "query_inventory",
            {"sku": "KT-220-BL", "stock": {"BER": 0, "HAM": 14, "MUC": 3}},
        ),
        A("Yes: 14 in Hamburg and 3 in Munich. Berlin is out of stock."),
        U("Email the Berlin team so they can reorder."),
        call(
            "call_m1",
            "send_email",
            {
                "to": "berlin-warehouse@example.com",
                "subject": "Reorder KT-220-BL (blue kettle)",
                "body": "Hello,\n\nBerlin has no blue kettles (KT-220-BL) left; Hamburg has 14 and Munich 3. Please reorder or request a transfer.\n\nThanks",
            },
        ),
        result("call_m1", "send_email", {"status": "sent"}),
        A(
            "Sent. The Berlin team knows Hamburg has 14 units if they prefer a transfer to a reorder."
        ),
    ],
    [
        U("¿Por qué el cielo es azul?"),
        A(
            "Porque la atmósfera dispersa la luz azul mucho más que la roja. La luz del Sol contiene "
            "todos los colores; al atravesar el aire, las moléculas de nitrógeno y oxígeno la desvían "
            "en todas direcciones, y esta dispersión de Rayleigh es más intensa cuanto más corta es "
            "la longitud de onda. Por eso, miremos donde miremos, nos llega luz azul dispersada.\n\n"
            "Al atardecer, la luz recorre un camino mucho más largo por la atmósfera: casi todo el "
            "azul se pierde por el camino y predominan el naranja y el rojo."
        ),
    ],
    [
        S("You are a maths assistant; use the calculator for exact results."),
        U("What is 17.5% of 2,340, and what is (2^20 - 1) / 3?"),
        call("call_x1", "calculate", {"expression": "2340 * 17.5 / 100"}),
        result("call_x1", "calculate", {"result": "409.5"}),
        call("call_x2", "calculate", {"expression": "(2^20 - 1) / 3"}),
        result("call_x2", "calculate", {"result": "349525"}),
        A("17.5% of 2,340 is 409.5, and (2^20 − 1) / 3 = 1,048,575 / 3 = 349,525 exactly."),
    ],
    [
        U("请帮我写一个 Python 函数，判断一个字符串是不是回文，忽略大小写和标点。"),
        A(
            "可以先只保留字母和数字，再统一转成小写，然后和反转后的字符串比较：\n\n```python\n"
            "def is_palindrome(text: str) -> bool:\n    chars = [c.lower() for c in text if c.isalnum()]\n"
            '    return chars == chars[::-1]\n\n\nprint(is_palindrome("A man, a plan, a canal: Panama"))  # True\n'
            "```\n\n`str.isalnum()` 对中文字符也返回 True，所以“上海自来水来自海上”同样可以判断。"
        ),
    ],
    [
        S("You help researchers find literature."),
        U("Find papers on low-bit quantization of language models from 2022 to 2024."),
        call(
            "call_p1",
            "search_papers",
            {
                "keywords": "low-bit quantization language models",
                "year_from": 2022,
                "year_to": 2024,
            },
        ),
        result(
            "call_p1",
            "search_papers",
            {
                "results": [
                    {
                        "title": "Post-training quantization with second-order information",
                        "year": 2022,
                        "citations": 1630,
                    },
                    {
                        "title": "Activation-aware weight quantization",
                        "year": 2023,
                        "citations": 910,
                    },
                    {
                        "title": "Incoherence processing for 2-bit weights",
                        "year": 2023,
                        "citations": 420,
                    },
                ]
            },
        ),
        A(
            "Three frequently cited ones: a 2022 paper on post-training quantization using "
            "second-order information (1,630 citations), a 2023 paper on activation-aware weight "
            "quantization (910) and a 2023 paper on incoherence processing for 2-bit weights (420). "
            "The first two target 3 to 4 bits per weight; the third pushes to 2 bits."
        ),
    ],
    [
        U("Расскажи коротко, чем отличается TCP от UDP."),
        A(
            "TCP устанавливает соединение и гарантирует доставку: данные приходят целиком, без "
            "потерь и в правильном порядке, а при перегрузке сети отправитель замедляется. UDP "
            "просто отправляет отдельные датаграммы — без соединения, подтверждений и повторов.\n\n"
            "Поэтому TCP используют там, где важна точность (веб, почта, передача файлов), а UDP — "
            "где важнее задержка: видеозвонки, онлайн-игры, DNS."
        ),
    ],
    [
        S("You control the smart home. Confirm every change."),
        U("It's cold in the study. Set it to 21.5 degrees, and the bedroom to 18."),
        call("call_h1", "set_thermostat", {"room": "study", "celsius": 21.5}),
        result("call_h1", "set_thermostat", {"room": "study", "target": 21.5, "current": 17.9}),
        call("call_h2", "set_thermostat", {"room": "bedroom", "celsius": 18}),
        result("call_h2", "set_thermostat", {"room": "bedroom", "target": 18, "current": 19.2}),
        A(
            "The study is set to 21.5 °C (it is 17.9 °C now, so the heating is on) and the bedroom "
            "to 18 °C (19.2 °C now; it will cool down gently)."
        ),
    ],
    [
        U("日本の四季について、それぞれ一文ずつ教えてください。"),
        A(
            "春は桜が咲き、新しい学年や仕事が始まる季節です。\n夏は高温多湿で、各地で花火大会や祭りが開かれます。\n"
            "秋は紅葉が美しく、食べ物がおいしい季節とされています。\n冬は日本海側で雪が多く、太平洋側は乾燥した晴れの日が続きます。"
        ),
    ],
    [
        S("You are a careful code reviewer for Go."),
        U(
            "Is this safe to call from many goroutines?\n\n```go\nvar hits = map[string]int{}\n\n"
            "func Record(path string) {\n\thits[path]++\n}\n```"
        ),
        A(
            "No. Go maps are not safe for concurrent writes, and the runtime may stop the program with "
            "`fatal error: concurrent map writes`. Guard it with a mutex:\n\n```go\nvar (\n\tmu   sync.Mutex\n"
            "\thits = map[string]int{}\n)\n\nfunc Record(path string) {\n\tmu.Lock()\n\tdefer mu.Unlock()\n"
            "\thits[path]++\n}\n```\n\nRun your tests with `go test -race` to catch the next one."
        ),
    ],
    [
        S("You are a patient maths tutor."),
        U("Factor x^2 - 5x + 6 and give the roots."),
        A(
            "Look for two numbers whose product is 6 and whose sum is -5: they are -2 and -3.\n\n"
            "So x^2 - 5x + 6 = (x - 2)(x - 3), and the roots are x = 2 and x = 3.\n\n"
            "In LaTeX: $x^2 - 5x + 6 = (x-2)(x-3)$, so $x \\in \\{2, 3\\}$. Check: $2 + 3 = 5$ and "
            "$2 \\cdot 3 = 6$."
        ),
    ],
    [
        U("Show me what's in the src folder of my project."),
        call("call_d1", "list_directory", {"path": "src", "recursive": False}),
        result(
            "call_d1",
            "list_directory",
            [
                {"name": "main.rs", "bytes": 2210},
                {"name": "config.rs", "bytes": 5384},
                {"name": "net", "bytes": None},
            ],
        ),
        A(
            "`src` holds `main.rs` (2.2 KB), `config.rs` (5.4 KB) and a `net` directory. Want me to look inside `net`?"
        ),
    ],
]
