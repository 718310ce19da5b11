"""The engines: what an engine is (``base``: the contract, the handle, the failure model), the
backends by name (``registry``: ``model.engine``) and vLLM's (``vllm``), the machine's shared
engine (``shared``) and its devices (``devices``), the model's identity (``model``), and the query
path of ``newsvec search`` (``query``)."""
