"""The machine's shared engine (``model.share_across_processes``): one engine per machine, in a
process of its own, and the client each SDK process reaches it with.

Beam's ``multi_process_shared`` spawns the engine's process (``server._SharedEngine`` makes its
handle there, ``server._ServedEngine`` serves it) and hands every SDK process a proxy.
``client.shared_engine`` gives each SDK process one ``client.SharedEngineClient`` per step, which:
- reaches or spawns the engine within ``model.load_timeout_s`` (a load that hangs is ended, and
  is an ``EngineFailedError``, as is a wait that long for another process to start it); the
  threads of a process share one attempt, and a failed one is remembered for a few seconds;
- bounds every call: the engine writes which call it is in and a heartbeat every second
  (``records._EngineState``); an engine in one call for over ``model.call_timeout_s``, or silent
  (no heartbeat) for as long, or stopped (SIGSTOP, a debugger), is ended and replaced; and a call
  that gets no answer from an engine that is alive and serving others fails after its turn
  could have come (``EngineFailedError``), so no call waits without bound;
- replaces the engine when its process is gone. A call whose engine ended while in another
  process's call (or with the SDK process that spawned it, or killed by something newsvec did not
  send: the out-of-memory killer, an operator) is retried on the next engine; one whose engine
  ended in the call itself (a crash, a hang) is checked with the new engine's canary: a canary
  that fails is an ``EngineFailedError``, one that passes makes the call an input failure
  (``client.EngineEndedInCall``), which the handler bisects like any other, so an input that
  kills the engine takes only itself;
- never lets two engines run for one tag (one GPU): each engine is a generation of the tag, with
  its own Beam tag and address file (``records._EngineRecord``), so an exit hook of Beam's that
  deletes an address file (it does not check whose it is) can only delete its own generation's.
  The engine runs in a process group of its own, and ending it ends the group: what it started
  (vLLM's engine core, with ``VLLM_ENABLE_V1_MULTIPROCESSING`` on) goes with it, and a new
  generation starts only once nothing of the last one runs.

A worker with several GPUs runs one such engine per GPU (``model.gpus_per_worker``), each pinned
to its device, and each SDK process is given one of them (``transforms.engines.devices``).

Only the job's user reaches the engine (``transport``): it serves on a Unix socket, 0600, in one
private folder (0700, this user's), takes connections only from processes of this user, and
authenticates with a random key of its own as well. Every file the engine and its clients meet at
is in that folder, written 0600 and read only if no other user could have written it: Beam's
``{tag}-g<n>.address``, ``.key`` and ``.lock``, the socket (``<hash of {tag}-g<n>>.sock``), and
newsvec's ``{tag}.engine``, ``{tag}.lock``, ``{tag}.busy``, ``{tag}.loading``,
``{tag}-g<n>.ended`` and ``{tag}-g<n>.exit``.

Its rooms, from the SDK process down:
- ``client``: ``SharedEngineClient`` (timed calls, retries, the canary after an end in a call),
  ``shared_engine`` (one client per tag and process, one engine per GPU), ``deaths_allowed``;
- ``life``: ``EngineLife``, the engine's life as a client sees it: reach or spawn it, one
  generation at a time, end and replace it, and blame (was an end in a call that call's doing);
- ``server``: the engine's own process: the handle it loads, its calls in turn, its heartbeat;
- ``records``: the files they tell each other through (the busy file, the engine record);
- ``transport``: the private folder, the key, the Unix socket and Beam's spawn on it;
- ``processes``: Linux processes: identity, state, process group, ending one, OOM kills.
"""
