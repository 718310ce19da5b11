"""The engines: what an engine is (``base``: the contract, the handle, the failure model), the
backends by name (``registry``: ``model.engine``) and vLLM's (``vllm``), the machine's shared
engine (``shared``) and its devices (``devices``), the model's identity (``model``; which files make
it and their hash: ``model_files``; a ``gs://`` folder fetched: ``fetch``), what its folder says
(``model_facts``), and the query path of ``newsvec search`` (``query``)."""
