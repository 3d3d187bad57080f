"""The 'torch_compile' guard (pydflash/guards/torch_compile.py): a compiled module's
first calls go through the compile queue."""

from __future__ import annotations

import threading

import pytest


def test_first_calls_of_a_compiled_module_go_through_the_queue(guard_module):
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")  # install_guards() installs every guard
    from pydflash import compile_queue

    guard = guard_module.install_guards()
    try:
        torch.manual_seed(0)
        module = torch.nn.Linear(8, 8)
        compiled = torch.compile(module, backend="eager")
        assert guard.features.get("torch_compile")  # patched once torch._dynamo was imported
        inputs = [torch.randn(4, 8) for _ in range(4)]
        barrier = threading.Barrier(4)
        results: list = [None] * 4

        def body(i: int) -> None:
            barrier.wait()
            with torch.no_grad():
                results[i] = compiled(inputs[i])

        threads = [threading.Thread(target=body, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with torch.no_grad():
            assert all(torch.allclose(r, module(x)) for r, x in zip(results, inputs, strict=True))
        first_calls = [
            k
            for k in compile_queue.stats()["keys"]
            if k.startswith(f"torch.compile:Linear@{id(compiled):x}")
        ]
        assert first_calls  # at least the first call went through the queue
    finally:
        guard.uninstall()
