"""``LmshmConnector``: a vLLM v1 KV connector that offloads and reuses KV blocks through lmshm-server.

Load it with::

    KVTransferConfig(kv_connector="LmshmConnector", kv_connector_module_path="lmshm.integrations.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"lmshm.url": "tcp://127.0.0.1:5555"})

One module per job: ``connector`` (the class: vLLM's calls translated into the engine-neutral
``lmshm.integrations.adapter``), ``settings`` (the ``lmshm.*`` keys), ``layout`` (which KV
tensors are registered, with which block dimension), ``stats`` (vLLM's stats and metrics).
docs/vllm.md says what it does, what a key covers, and which layouts and models it serves.
"""

from lmshm.integrations.vllm.connector import LmshmConnector, LmshmConnectorMetadata, LmshmWorkerMetadata
from lmshm.integrations.vllm.layout import LayoutRefused, block_view, cache_groups, registration_groups
from lmshm.integrations.vllm.stats import LmshmConnectorStats

__all__ = ["LayoutRefused", "LmshmConnector", "LmshmConnectorMetadata", "LmshmConnectorStats", "LmshmWorkerMetadata",
           "block_view", "cache_groups", "registration_groups"]
