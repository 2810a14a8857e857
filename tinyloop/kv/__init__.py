"""The KV cache and prefix sharing: ``cache`` (the paged KV cache), ``handles`` (prefix
handles, the pool, the prefix file format)."""
