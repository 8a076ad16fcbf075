"""OpenAI-compatible HTTP API in front of the Triton generate models.

protocol       request bodies (OpenAI's fields and vLLM's extra sampling fields)
sampling       request -> Triton ``sampling_parameters``; what is not supported is a 400
chat_template  chat messages -> prompt text with the checkpoint's Jinja template, or a fallback
served         the served model: name, Triton model, tokenizer, template, context length
triton_bridge  gRPC streams to Triton (``tritonclient.grpc.aio``), cancelled when closed early
generation     one request -> one JSON body or a stream of SSE chunks
responses      response bodies and chunks
sse            SSE encoding; the client-disconnect watch that cancels the Triton request
errors         OpenAI error objects and status codes
routes, app    the endpoints and the FastAPI application
health         ``/health``: Triton's readiness, checked in the background
options, server  flags, and running it with uvicorn (foreground or beside ``splitserve serve``)

Nothing is imported here, so the flags can be read without FastAPI installed.
"""
