"""What a request constrains its output to; the engine compiles it into a grammar (llmc.runtime.engine.grammar)."""
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """kind json_object: any JSON object; json_schema: spec is a JSON schema; structural_tag: spec is an xgrammar
    structural tag (text with tagged JSON parts, such as tool calls). field names the request field it came from."""

    kind: Literal["json_object", "json_schema", "structural_tag"]
    spec: str = ""
    field: str = "response_format"
