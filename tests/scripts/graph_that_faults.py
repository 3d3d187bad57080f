"""A captured CUDA graph whose kernel trips a device-side assert, launched natively on a
GPU lane (Lane.submit_graph). Its failure is a typed C++ error stored on the native
future (csrc/python/tasks.cpp) and raised as pydflash.CudaError naming the lane. Run in
a child process: the assert poisons the CUDA context for good.

Prints `<exception type>|<message>` of the launch's future.
"""

import torch

import pydflash

with pydflash.Dispatcher([0], guard=()) as dispatcher:
    lane = dispatcher.lanes[0]
    table = torch.zeros(4, device="cuda")
    index = torch.tensor([1000], device="cuda")  # out of range: the kernel asserts

    def capture():
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            table[index].add_(1)  # no check on the host while capturing
        return graph

    graph = lane.submit(capture).result()
    launch = lane.submit_graph(graph)
    try:
        launch.result(60)
        print("no error|")
    except Exception as error:  # noqa: BLE001 - printed for the parent to check
        print(f"{type(error).__name__}|{error}")
