"""sglang.lang.backend.*: the backends, one module each by SGLang's file names."""
