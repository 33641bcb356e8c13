"""sgnb serve: SGLang's native HTTP API and the OpenAI-compatible API over one in-process `Engine`.

    app = create_app(engine)                        # an ASGI app (Starlette)
    serve(engine, port=30000)                       # blocking, for the `sgnb serve` command
    handle = start_server_thread(engine, port=0)    # in a notebook: a background thread with its own loop
    handle.url, handle.stop()

Modules: `protocol` (errors as JSON, bodies in and out, the request schemas, request ids, OpenAI response
pieces; the tool-call machinery is `sgnb.tools`), `access` (ServerOptions and the guard in front of every route), `streaming` (SSE that stops when the
client leaves, interleaved engine streams), `media` (images and videos from clients), `native_api`,
`openai_api` and `responses_api` (the route handlers), `app` (the app, `serve`, `ServerThread`).

Native API (what SGLang's `RuntimeEndpoint` speaks): POST /generate, GET /get_model_info (/model_info),
GET /get_server_info (/server_info), POST /flush_cache, GET /health, GET /health_generate, POST /abort_request,
POST /concate_and_append_request (accepted: KV is found by text, nothing moves). A /generate stream's chunks
carry the text and output logprobs so far, as SGLang's server by default, or only the new ones with
`--incremental-streaming-output` (ServerOptions.incremental_streaming_output; /get_server_info says which).
Tool calls (`sgnb.tools`, shared with the language's gen(tools=...)) are the OpenAI routes'.
OpenAI API: GET /v1/models, GET /v1/models/{model}, POST /v1/completions, POST /v1/chat/completions,
POST /v1/responses (the Responses API over the chat route's machinery: text or message input, instructions,
structured output, function tools, streaming with its typed events; stateless), POST /v1/embeddings (a 400: the
model is generative), and SGLang's POST /tokenize and /detokenize (also under /v1/). response_format (text,
json_object, json_schema) constrains /v1/completions as it does chat. The `model` field is not checked (SGLang's
way) unless ServerOptions.strict_model_name (`--strict-model-name`): then another name than the served one
(`--served-model-name`) is OpenAI's 404 model_not_found.

Access (ServerOptions, `sgnb serve --api-key/--admin-api-key/--allowed-hosts`): with a key, every route but
/health needs `Authorization: Bearer KEY` (401); without one, only requests for the bound address or a loopback
name, from no foreign Origin, with JSON bodies (or none: `curl -X POST .../flush_cache`) are answered (403 / 415),
so a web page cannot drive the server.
Limits (docs/security.md): the body's size (413), n, samples per request, top_logprobs_num (400), the time to send
a request (closed); the engine's: grammar size and compile time, image pixels, video frames (400).

Contracts:
- Every error is JSON `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status: malformed JSON,
  wrong types and unknown fields (request schemas forbid extras, so a typo names itself) and the engine's
  TypeError/ValueError are 400 (an invalid regex / json_schema / ebnf too); features the engine lacks (audio,
  OpenAI's deprecated functions / function_call) are 400 "not supported yet"; a dead engine is 503. Tools on
  /v1/chat/completions: tool_choice "required" or a named function constrains the reply to a call of the
  allowed functions (JSON schema from their parameters); "auto" switches to that once the model opens a call. One request's failure never affects another's.
- Images and videos (multimodal models): /generate takes SGLang's `image_data` / `video_data` (for one prompt an
  item or a list, for a batch one entry per prompt), /v1/chat/completions content parts `image_url` and
  `video_url` (an extension: {"url", "num_frames"}). Each item is a data: URL or a plain base64 string (a video
  also {"url" | "data": ..., "num_frames": n}). The server reads no local files and fetches no URLs for its
  clients: a path or an http(s) URL is a 400, as are undecodable media and media for a text-only model.
  /get_model_info, /get_server_info and /v1/models say whether the model takes images ("image_token",
  "video_token").
- A client that goes away aborts its requests: a non-streaming handler races the engine against the
  connection's `http.disconnect`; a stream stops sending and closes its engine iterators, which abort.
- Handlers run on the server's event loop and never block it: the engine works on its own thread, and large
  bodies, chat rendering and tokenizing, grammar parsing and media decoding run on worker threads.
- A string with a lone UTF-16 surrogate anywhere in a body is a 400 naming where (no tokenizer takes one).
"""

from sgnb.server.access import ServerOptions
from sgnb.server.app import ServerThread, create_app, serve, start_server_thread
from sgnb.server.protocol import APIError
from sgnb.server.streaming import EventStream

__all__ = ["APIError", "EventStream", "ServerOptions", "ServerThread", "create_app", "serve", "start_server_thread"]
