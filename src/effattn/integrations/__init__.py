"""Integrations with other libraries; each is an optional extra and is imported on demand.

- :mod:`effattn.integrations.transformers` (extra ``hf``): every effattn method as a Hugging Face
  ``attn_implementation`` named ``effattn-<method>``, and a fixed-size decoding cache for
  ``generate()``.

Importing :mod:`effattn` never imports these modules (nor the libraries they need).
"""
