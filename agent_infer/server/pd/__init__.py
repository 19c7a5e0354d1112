"""Prefill/decode disaggregation in sglang-router's PD mode (see docs/serving.md).

The router sends each request to a prefill worker and a decode worker at once, both carrying
``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room``. The prefill worker computes the
prompt's KV and first token and holds them under the room (:mod:`.prefill`); the decode worker
asks the prefill worker's bootstrap endpoint for the room, reads the KV blocks into its own pool
with Mooncake's transfer engine (:mod:`.transfer`) and decodes from the first token on without
running the prompt (:mod:`.decode`).
"""
