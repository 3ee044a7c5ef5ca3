"""Adapters that plug mmfeat into inference servers by configuration.

Each adapter depends on ``mmfeat.client`` alone and imports its server lazily, so that importing
``mmfeat`` never imports vLLM or SGLang: ``vllm`` is an encoder-cache (EC) connector that vLLM loads by
``ec_connector_module_path``; ``sglang`` is an encoder delivery and receiver for SGLang's encoder
disaggregation.
"""
