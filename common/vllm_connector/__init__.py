"""PrfaaS as a vLLM KV connector (an optional extra): vLLM engines become PrfaaS prefill and decode
workers, their KV moving over this project's transfer engine (:mod:`common.transfer`).

* :mod:`.plan`: the pure decisions (request parameters, which blocks a step sends, wire layouts,
  what a finished load reports); no vLLM, no sockets.
* :mod:`.engine`: the transfer engine on a background event loop inside vLLM's worker: a producer's
  pushes (one :class:`~common.transfer.sender.KvLink` per decode address) and a consumer's listener
  whose frames land in vLLM's paged blocks (:class:`~.engine.BlockAssembly`).
* :mod:`.connector`: ``PrfaasConnector``, the ``KVConnectorBase_V1`` subclass vLLM loads with
  ``--kv-transfer-config '{"kv_connector": "PrfaasConnector", "kv_connector_module_path":
  "common.vllm_connector.connector", ...}'`` (this project on the vLLM venv's ``PYTHONPATH``; the
  venv needs only ``msgpack`` and ``zstandard`` beyond vLLM). Only that module imports vLLM.
"""
