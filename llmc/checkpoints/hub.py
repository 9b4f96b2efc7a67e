"""Whether the Hugging Face hub can be reached, asked once with a short timeout: offline, a hub name fails in
seconds with advice, instead of after the hub clients' retries."""
import functools
import os
import urllib.error
import urllib.request

from llmc.core.errors import LlmcError

PROBE_TIMEOUT_S = 3.0


@functools.cache
def hub_unreachable_reason() -> str | None:
    """None when the hub answers; else why not (offline mode set, or the connection failed)."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return "HF_HUB_OFFLINE is set"
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/api/whoami-v2", method="HEAD"), timeout=PROBE_TIMEOUT_S)
    except urllib.error.HTTPError:
        return None  # it answered, if only to say who we are not
    except (urllib.error.URLError, OSError) as error:
        return f"{endpoint} did not answer ({getattr(error, 'reason', error)})"
    return None


def require_hub(what: str, local_alternative: str) -> None:
    """An LlmcError naming `what` and how to do without the hub, when the hub cannot be reached."""
    reason = hub_unreachable_reason()
    if reason is not None:
        raise LlmcError(f"{what} comes from the Hugging Face hub, which cannot be reached: {reason}; {local_alternative}")
