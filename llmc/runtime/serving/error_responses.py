"""OpenAI-style error bodies, and the error responses the OpenAPI schema documents for every /v1 route."""
from fastapi.responses import JSONResponse
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorBody(BaseModel):
    error: ErrorDetail


def error_response(status: int, message: str, error_type: str, headers: dict | None = None) -> JSONResponse:
    body = ErrorBody(error=ErrorDetail(message=message, type=error_type, code=status))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


ERROR_RESPONSES: dict[int | str, dict] = {
    status: {"model": ErrorBody, "description": description}
    for status, description in {
        400: "A field is invalid or past its limit (the message names it)",
        401: "The API key is missing or wrong",
        404: "The model named is not served here",
        413: "The body is larger than --max-request-bytes",
        500: "The engine failed on this request (the server goes on serving the others)",
        503: "The server is at capacity (retry after Retry-After), or its engine has stopped",
    }.items()
}
