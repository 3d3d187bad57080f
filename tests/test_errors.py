"""Bad input gets a typed error that says what was expected; one test per mapping."""

import concurrent.futures
import pickle

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


def test_negative_spin_is_a_value_error():
    with pytest.raises(ValueError, match="spin_us >= 0"):
        pydflash.Dispatcher(["cpu"], guard=(), spin_us=-1)


def test_graph_on_a_cpu_lane_is_a_value_error():
    with (
        pydflash.Dispatcher(["cpu"], guard=()) as d,
        pytest.raises(ValueError, match="CPU lane"),
    ):
        d.lanes[0]._native.submit_graph(1, None, d.lanes[0])


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
