"""Bad input gets a typed error that says what was expected; one test per mapping."""

import concurrent.futures
import copy
import multiprocessing
import pickle
import re
import threading

import pytest

import pydflash
from pydflash import errors


def gpus():
    return pydflash._C.device_count()


@pytest.mark.parametrize("spec", [7, "cuda:7", -2])
def test_out_of_range_device_is_a_value_error(spec):
    with pytest.raises(ValueError, match=r"expected .*'cpu'.*got"):
        pydflash.Dispatcher([gpus() + 7 if spec == 7 else spec], guard=())


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "cpu:0 "])
def test_unknown_device_string_is_a_value_error(spec):
    with pytest.raises(ValueError, match="got"):
        pydflash.Dispatcher([spec], guard=())


@pytest.mark.parametrize("spec", [1.5, None, True, object()])
def test_device_of_the_wrong_type_is_a_type_error(spec):
    with pytest.raises(TypeError, match="expected a device"):
        pydflash.Dispatcher([spec], guard=())


def test_max_workers_is_a_type_error_showing_the_devices_call():
    # ThreadPoolExecutor's habit; lanes are per device.
    with pytest.raises(TypeError) as e:
        pydflash.Dispatcher(max_workers=3)
    message = str(e.value)
    assert message.startswith("expected devices, one lane per entry, got max_workers=3")
    assert "Dispatcher(devices=['cpu'] * 3)" in message and "Dispatcher(devices=[0, 1])" in message


def test_empty_devices_is_a_value_error():
    with pytest.raises(ValueError, match="at least one device"):
        pydflash.Dispatcher([], guard=())


def test_torch_device_is_accepted():
    torch = pytest.importorskip("torch")
    with pydflash.Dispatcher([torch.device("cpu")], guard=()) as d:
        assert d.on(torch.device("cpu")).device == "cpu"


def test_on_a_device_without_a_lane_names_the_lanes():
    with pydflash.Dispatcher(["cpu"], guard=()) as d:
        # Without a GPU, cuda:0 is not a device at all; with one, it has no lane here.
        match = r"with a lane \(cpu\)" if gpus() else r"expected 'cpu'.*got 'cuda:0'"
        with pytest.raises(ValueError, match=match):
            d.on("cuda:0")


def test_non_callable_is_a_type_error():
    with pydflash.Dispatcher(["cpu"], guard=()) as d:
        with pytest.raises(TypeError, match="expected a callable, got int"):
            d.submit(3)
        with pytest.raises(TypeError, match="expected a callable, got str"):
            d.lanes[0].submit("f")
        with pytest.raises(TypeError, match="missing the callable"):
            d.submit()


@pytest.mark.parametrize("lanes", [1, 2])
def test_submit_after_shutdown_is_a_runtime_error_in_the_stdlibs_words(lanes):
    pool = concurrent.futures.ThreadPoolExecutor()
    pool.shutdown()
    with pytest.raises(RuntimeError) as stdlib:
        pool.submit(print)
    d = pydflash.Dispatcher(["cpu"] * lanes, guard=())
    d.shutdown()
    # Named after what the caller submitted to: the Dispatcher, not a lane it picked.
    for executor in (d, d.lanes[0]):
        with pytest.raises(RuntimeError) as ours:
            executor.submit(print)
        assert str(ours.value) == f"{stdlib.value} of {executor!r}"


@pytest.mark.parametrize("spin_us", [-1, 1e30, float("inf"), float("nan"), 1_000_001])
def test_spin_out_of_range_is_a_value_error(spin_us):
    # Up to a second (C.MAX_SPIN_US): a longer window would overflow, and a shutdown
    # must not wait it out.
    expected = r"expected spin_us in \[0, 1e\+06\] \(microseconds\), got "
    with pytest.raises(ValueError, match=expected + re.escape(repr(spin_us))):
        pydflash.Dispatcher(["cpu"], guard=(), spin_us=spin_us)


@pytest.mark.parametrize("spin_us", ["x", None, True])
def test_spin_of_the_wrong_type_is_a_type_error(spin_us):
    with pytest.raises(TypeError, match=r"^expected spin_us in microseconds, got "):
        pydflash.Dispatcher(["cpu"], guard=(), spin_us=spin_us)


def test_cancel_futures_of_the_wrong_type_is_a_type_error():
    d = pydflash.Dispatcher(["cpu"], guard=())
    for executor in (d, d.lanes[0]):
        with pytest.raises(TypeError, match=r"^expected cancel_futures=True or False, got str$"):
            executor.shutdown(cancel_futures="yes")
    d.shutdown()


def test_devices_as_bytes_is_a_type_error():
    with pytest.raises(TypeError, match=r"^expected a device or a list of devices .*got bytes$"):
        pydflash.Dispatcher(b"cpu", guard=())


def test_lane_index_of_the_wrong_type_is_a_type_error():
    with pydflash.Dispatcher(["cpu"], guard=()) as d:
        with pytest.raises(TypeError, match=r"^expected a lane index as an int, got str$"):
            d.on("cpu", "0")
        assert d.on("cpu", 0) is d.lanes[0]


def test_trace_to_a_file_descriptor_is_a_type_error(tmp_path):
    # open() would write to the descriptor and close it.
    with pydflash.Dispatcher(["cpu"], guard=(), trace=True) as d:
        d.submit(int).result()
        expected = r"^expected a file path \(str or os.PathLike\), got int$"
        with pytest.raises(TypeError, match=expected):
            d.export_trace(42)
        assert d.export_trace(tmp_path / "trace.json")["traceEvents"]  # the spans are kept


def test_forwarding_what_is_not_an_exception_is_a_type_error():
    with pydflash.Dispatcher(["cpu"], guard=()) as d:
        future = d.submit(int, 3)
        with pytest.raises(TypeError, match=r"^expected an exception, got str$"):
            future.forward_failure("str")
        assert future.result() == 3


TOO_LONG = "expected a timeout of at most threading.TIMEOUT_MAX (9223372036 s), or None or "
TOO_LONG += "float('inf') to wait forever, got "


@pytest.mark.parametrize(
    ("timeout", "got"),
    [(1e10, "10000000000.0"), (10**10, "10000000000"), (10**400, None)],
    ids=["1e10", "10**10", "10**400"],
)
def test_timeout_past_timeout_max_is_an_overflow_error(timeout, got):
    # As threading's own waits refuse it, rather than a deadline in the past.
    said = TOO_LONG + (got or "an int too large to convert to float")
    with pydflash.Dispatcher(["cpu"], guard=()) as d:
        gate = threading.Event()
        future = d.submit(gate.wait)
        waits = {
            "result": lambda: future.result(timeout),
            "exception": lambda: future.exception(timeout),
            "wait_all": lambda: pydflash.wait_all([future], timeout),
            "join": lambda: d.lanes[0].join(timeout),
        }
        for name, wait in waits.items():
            with pytest.raises(OverflowError) as raised:
                wait()
            assert str(raised.value) == said, name
        gate.set()


def test_graph_on_a_cpu_lane_is_a_value_error():
    with (
        pydflash.Dispatcher(["cpu"], guard=()) as d,
        pytest.raises(ValueError, match="CPU lane"),
    ):
        d.lanes[0]._core.submit_graph(1, None, d.lanes[0])


def test_cuda_call_without_a_device_is_a_cuda_error():
    if not pydflash._C.compiled_with_cuda() or gpus():
        pytest.skip("needs a CUDA build on a machine without a usable GPU (CI)")
    with pytest.raises(errors.CudaError, match="CUDA error"):
        pydflash._C.busy_wait(0, 1000)


@pytest.mark.parametrize(
    "cls",
    [
        errors.CudaError,
        errors.InternalError,
        errors.NativeModuleError,
        errors.UnsupportedTritonError,
        errors.CompileQueueTimeout,
        errors.GraphCaptureError,
        errors.PipelineError,
    ],
)
def test_errors_are_picklable_and_share_a_base(cls):
    err = pickle.loads(pickle.dumps(cls("message")))
    assert type(err) is cls and str(err) == "message"
    assert isinstance(err, errors.PydflashError)


@pytest.mark.parametrize("what", ["Dispatcher", "Lane"])
@pytest.mark.parametrize(
    "how", [pickle.dumps, copy.copy, copy.deepcopy], ids=["pickle", "copy", "deepcopy"]
)
def test_pickling_or_copying_a_dispatcher_or_lane_is_a_type_error_saying_what_to_do(what, how):
    # Issue 35: a PicklingError about Triton's Autotuner.run, or "cannot pickle 'module'".
    with pydflash.Dispatcher(["cpu"], guard=()) as d:
        target = d if what == "Dispatcher" else d.lanes[0]
        with pytest.raises(
            TypeError,
            match=rf"^a pydflash\.{what} cannot be pickled or copied: its lanes are native "
            r"worker threads .*Make .* in the process that uses it \(in a child, once it has "
            r"started\)",
        ):
            how(target)


def test_a_spawned_process_given_a_dispatcher_gets_the_type_error():
    ctx = multiprocessing.get_context("spawn")
    with (
        pydflash.Dispatcher(["cpu"], guard=()) as d,
        pytest.raises(TypeError, match=r"^a pydflash\.Dispatcher cannot be pickled"),
    ):
        ctx.Process(target=print, args=(d,)).start()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("a", "b"), r"^expected index as an int, got str$"),
        ((0, "cpu"), r"^expected device as a CUDA ordinal \(int\) or -1 for the CPU, got str$"),
        ((True, -1), r"^expected index as an int, got bool$"),
    ],
)
def test_a_lane_of_the_wrong_types_is_a_type_error(args, message):
    with pytest.raises(TypeError, match=message):
        pydflash.Lane(*args)


def test_set_tracing_of_the_wrong_type_is_a_type_error():
    with pydflash.Dispatcher(["cpu"], guard=()) as d:
        with pytest.raises(TypeError, match=r"^expected on=True or False, got str$"):
            d.lanes[0].set_tracing("x")
        with pytest.raises(TypeError, match=r"^expected on=True or False, got int$"):
            d.set_tracing(1)
