"""Tool definitions (OpenAI's function-tool shape) and argument pools, written for mlxinfer.

Two disjoint catalogs: the evaluation corpus uses EVAL, the calibration corpus CALIB."""


def fn(name, description, properties, required):
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def s(description, enum=None):
    out = {"type": "string", "description": description}
    if enum:
        out["enum"] = enum
    return out


def n(description, kind="number"):
    return {"type": kind, "description": description}


EVAL = [
    fn(
        "get_weather",
        "Current weather for a city: temperature, wind and sky.",
        {
            "city": s("City name, optionally with country"),
            "unit": s("Temperature unit", ["celsius", "fahrenheit"]),
        },
        ["city"],
    ),
    fn(
        "convert_currency",
        "Convert an amount of money between two ISO 4217 currencies at today's rate.",
        {
            "amount": n("Amount to convert"),
            "from": s("Source currency code"),
            "to": s("Target currency code"),
        },
        ["amount", "from", "to"],
    ),
    fn(
        "search_flights",
        "Search one-way flights between two airports on a date.",
        {
            "origin": s("IATA code of the departure airport"),
            "destination": s("IATA code of the arrival airport"),
            "date": s("Departure date, YYYY-MM-DD"),
            "passengers": n("Number of travellers", "integer"),
        },
        ["origin", "destination", "date"],
    ),
    fn(
        "read_file",
        "Read a text file from the user's workspace and return its contents.",
        {
            "path": s("Path relative to the workspace root"),
            "max_bytes": n("Stop after this many bytes", "integer"),
        },
        ["path"],
    ),
    fn(
        "run_sql",
        "Run a read-only SQL query against the analytics database and return rows as JSON.",
        {"query": s("A single SELECT statement"), "limit": n("Maximum rows returned", "integer")},
        ["query"],
    ),
    fn(
        "create_calendar_event",
        "Add an event to the user's calendar.",
        {
            "title": s("Short title of the event"),
            "start": s("Start time, ISO 8601"),
            "duration_minutes": n("Length of the event", "integer"),
            "attendees": {
                "type": "array",
                "items": {"type": "string"},
                "description": "Email addresses",
            },
        },
        ["title", "start"],
    ),
    fn(
        "translate_text",
        "Translate text into another language.",
        {"text": s("Text to translate"), "target_language": s("BCP 47 tag of the target language")},
        ["text", "target_language"],
    ),
    fn(
        "get_stock_quote",
        "Latest trade price and daily change for a ticker symbol.",
        {"symbol": s("Ticker symbol, e.g. ACME")},
        ["symbol"],
    ),
]

CALIB = [
    fn(
        "lookup_recipe",
        "Find recipes that use the given ingredients, with cooking time and servings.",
        {
            "ingredients": {
                "type": "array",
                "items": {"type": "string"},
                "description": "Ingredients on hand",
            },
            "max_minutes": n("Longest acceptable cooking time", "integer"),
        },
        ["ingredients"],
    ),
    fn(
        "send_email",
        "Send an email on the user's behalf.",
        {"to": s("Recipient address"), "subject": s("Subject line"), "body": s("Plain-text body")},
        ["to", "subject", "body"],
    ),
    fn(
        "get_route",
        "Travel time and distance between two places by a given mode of transport.",
        {
            "from": s("Start address or place name"),
            "to": s("Destination address or place name"),
            "mode": s("How to travel", ["walking", "cycling", "driving", "transit"]),
        },
        ["from", "to"],
    ),
    fn(
        "list_directory",
        "List the entries of a directory in the workspace, with sizes.",
        {
            "path": s("Directory path relative to the workspace root"),
            "recursive": {"type": "boolean"},
        },
        ["path"],
    ),
    fn(
        "calculate",
        "Evaluate an arithmetic expression exactly and return the result.",
        {"expression": s("Expression using + - * / ^ and parentheses")},
        ["expression"],
    ),
    fn(
        "set_thermostat",
        "Set the target temperature of a room's thermostat.",
        {"room": s("Room name"), "celsius": n("Target temperature in degrees Celsius")},
        ["room", "celsius"],
    ),
    fn(
        "query_inventory",
        "Stock level of a product in each warehouse.",
        {"sku": s("Product SKU"), "warehouse": s("Warehouse code; omit for all")},
        ["sku"],
    ),
    fn(
        "search_papers",
        "Search a library of research papers by keywords and year range.",
        {
            "keywords": s("Words to search for"),
            "year_from": n("Earliest publication year", "integer"),
            "year_to": n("Latest publication year", "integer"),
        },
        ["keywords"],
    ),
]
