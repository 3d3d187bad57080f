"""A device-side assert on a CUDA lane, for test_faults.py's
test_device_side_assert_names_the_lane_and_poisons_the_device: it runs in a child
because the assert leaves the device's CUDA context unusable for the rest of the
process.

Two lanes on cuda:0, and one on cuda:1 when there is one. Lane 0 indexes out of
bounds; then lane 0, lane 1 and the cuda:1 lane each run a small sum. Prints one line,
"REPORT " and a JSON object: the GPU count, the lanes' labels, and for each of those
tasks {"ok": result} or its error's name, message and notes.
"""

import json

import torch

import pydflash


def assert_on_device() -> float:
    x = torch.zeros(4, device=torch.cuda.current_device())
    index = torch.tensor([10], device=x.device)  # out of bounds: the kernel asserts
    return x[index].sum().item()  # .item() waits, so the assert surfaces here


def work() -> float:
    return torch.ones(8, device=torch.cuda.current_device()).sum().item()


def outcome(future) -> dict:
    try:
        return {"ok": future.result(timeout=60)}
    except Exception as e:  # noqa: BLE001 - any error is what the report records
        return {
            "error": type(e).__name__,
            "runtime_error": isinstance(e, RuntimeError),
            "message": str(e)[:300],
            "notes": getattr(e, "__notes__", []),
        }


def main() -> None:
    gpus = torch.cuda.device_count()
    d = pydflash.Dispatcher([0, 0] + ([1] if gpus > 1 else []), guard=())
    lanes = d.lanes
    report = {"gpus": gpus, "labels": [lane.label for lane in lanes]}
    report["assert"] = outcome(lanes[0].submit(assert_on_device))
    report["same_lane_after"] = outcome(lanes[0].submit(work))
    report["same_device_other_lane_after"] = outcome(lanes[1].submit(work))
    if gpus > 1:
        report["other_device_after"] = outcome(lanes[2].submit(work))
    print("REPORT " + json.dumps(report), flush=True)
    d.shutdown(cancel_futures=True)


if __name__ == "__main__":
    main()
