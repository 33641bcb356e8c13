"""SGLang's frontend module paths, under sgnb: `from sglang.lang.ir import REGEX_INT` becomes
`from sgnb.lang.ir import REGEX_INT`, and so on for `sglang.lang.{api, choices, global_config, interpreter, ir}`
and `sglang.lang.backend.{base_backend, runtime_endpoint, openai, anthropic, litellm, vertexai, crusoe}`, so a
program ported by renaming its imports runs. Each module re-exports sgnb's object for SGLang's name; nothing is
defined here. `import sgnb as sgl` remains the way in: these paths are for code that imports from SGLang's
modules directly."""
