"""Every limit the server puts on a request, stated once. The request models carry them, so the OpenAPI schema shows
them and a request past one gets a 400 naming its field; the body's size is checked before it is parsed (413)."""

MAX_REQUEST_BYTES = 16 * 2**20  # the default of `llmc serve --max-request-bytes`
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds, as torch's generators take them
MAX_INT32 = 2**31 - 1  # counts (max_tokens, top_k) and token ids
MAX_NAME_CHARS = 256  # model, user, a tool call's id
MAX_PROMPTS = 1024  # prompts in one /v1/completions request (each answered n times, within the server's capacity)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # per stop string
MAX_STOP_TOKEN_IDS = 256
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 256  # per message
MAX_TOOLS = 128
MAX_TOOL_CALLS = 128  # per assistant message
HEALTH_STALL_SECONDS = 60.0  # the default of `llmc serve --health-stall-seconds`
