"""The executor: a lane per device with its native queue and worker, and what runs on it.

- lane.py: `Lane`, one native queue, worker thread and stream; `submit`, `submit_graph`.
- dispatcher.py: `Dispatcher`, the lanes of a process's devices (devices.py parses them).
- _future.py: `Future`, a concurrent.futures.Future completed natively;
  waiting.py: `wait_all`.
- handoff.py: tensors handed from one lane's stream to another's.
- quiesce.py: a quiet device while one lane captures a CUDA graph.
- graph_exec.py: the executable handle `Lane.submit_graph` launches.
- _lane_runtime.py, _torch_state.py: what the native worker calls by name (per-thread
  set-up, the caller's torch state); _exit.py: lanes at interpreter exit.

Nothing here imports the graphs, the pipeline or its stages.
"""
