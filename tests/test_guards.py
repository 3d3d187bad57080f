"""Holding guards (pydflash/guards/install.py): by name, once per process, released with
the last hold; what a Dispatcher holds and what warmup turns on."""

from __future__ import annotations

import sys

import pytest


def test_without_triton(guard_module, monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` fail
    assert guard_module.install_guards(missing_ok=True) is None
    with pytest.raises(ImportError, match="missing_ok=True"):
        guard_module.install_guards()
    assert not guard_module.is_guarded()


def test_a_dispatcher_installs_the_guard_unless_told_not_to(guard_module):
    pytest.importorskip("triton")
    from pydflash import Dispatcher

    bare = Dispatcher(["cpu"], guard=())
    assert not guard_module.is_guarded()
    bare.shutdown()
    guarded = Dispatcher(["cpu"])
    assert guard_module.is_guarded()
    guarded.shutdown(wait=False)  # lanes may still launch kernels: the guard stays
    assert guard_module.is_guarded()
    guarded.shutdown(wait=True)  # gives its hold back
    assert not guard_module.is_guarded()


def test_a_dispatcher_holds_the_guards_it_names(guard_module):
    from pydflash import Dispatcher

    assert guard_module.select(None) == ("triton", "fla", "torch_compile")
    assert guard_module.select(["torch_compile", "fla", "fla"]) == ("fla", "torch_compile")
    with Dispatcher(["cpu"], guard="torch_compile"):
        assert guard_module.installed() == ("torch_compile",)
        with Dispatcher(["cpu"], guard=("fla", "torch_compile")):
            assert guard_module.installed() == ("fla", "torch_compile")
        assert guard_module.installed() == ("torch_compile",)  # held by the outer one
    assert guard_module.installed() == ()
    with Dispatcher(["cpu"], guard=()):
        assert guard_module.installed() == ()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"guard": ("triton", "trition")},
            ValueError,
            "expected guard names from 'triton', 'fla', 'torch_compile', got 'trition'",
        ),
        ({"guard": True}, TypeError, "expected guard names as a str or an iterable of str"),
        (
            {"guard": "fla", "guard_triton": False},
            ValueError,
            "expected guard=None or \\(\\) with guard_triton=False, got guard='fla'",
        ),
    ],
    ids=["unknown-name", "not-names", "both-ways"],
)
def test_bad_guard_selections_are_refused_before_any_lane(guard_module, kwargs, error, match):
    from pydflash import Dispatcher

    with pytest.raises(error, match=match):
        Dispatcher(["cpu"], **kwargs)
    assert guard_module.installed() == ()


def test_a_selection_naming_triton_needs_triton(guard_module, monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` fail
    assert guard_module.guard(("fla", "triton"), missing_ok=True) is None
    assert guard_module.installed() == ()  # not even the guards that need no Triton
    with pytest.raises(ImportError, match="the 'triton' guard needs Triton"):
        guard_module.guard("triton")


def test_warmup_runs_on_every_lane_with_the_guard_on(guard_module):
    pytest.importorskip("triton")
    from pydflash import Dispatcher

    dispatcher = Dispatcher(["cpu"] * 3, guard=())
    try:
        seen = dispatcher.warmup(lambda x: (x * 2, guard_module.is_guarded()), [(1,), None, (3,)])
        assert seen == [(2, True), None, (6, True)]
        assert not guard_module.is_guarded()  # only for the warmup

        def fail(x):
            raise ValueError(f"lane input {x}")

        with pytest.raises(ValueError, match="lane input 1"):
            dispatcher.warmup(fail, [(1,), (2,), (3,)])
    finally:
        dispatcher.shutdown()


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((5, [(1,)]), TypeError, "expected a callable, got int"),
        ((print, 3), TypeError, "inputs_per_lane as a sequence of argument tuples, got int"),
        ((print, [(1,)]), ValueError, r"one entry of inputs_per_lane per lane \(2\), got 1"),
        (
            (print, [(1,), 2]),
            TypeError,
            r"inputs_per_lane\[1\] as a tuple of arguments or None, got int",
        ),
    ],
)
def test_warmup_rejects_bad_arguments(args, error, match):
    from pydflash import Dispatcher

    dispatcher = Dispatcher(["cpu"] * 2, guard=())
    try:
        with pytest.raises(error, match=match):
            dispatcher.warmup(*args)
    finally:
        dispatcher.shutdown()


def test_the_old_names_still_switch_every_guard_with_a_deprecation_warning(
    guard_module, monkeypatch
):
    import pydflash
    from pydflash import Dispatcher

    monkeypatch.setitem(sys.modules, "triton", None)  # the guards needing no Triton only
    with pytest.warns(DeprecationWarning, match="use pydflash.install_guards"):
        assert pydflash.guard_triton(missing_ok=True) is None
    guard_module.guard(("fla", "torch_compile"))
    with pytest.warns(DeprecationWarning, match="use pydflash.remove_guards"):
        pydflash.unguard_triton()
    assert guard_module.installed() == ()
    with pytest.warns(DeprecationWarning, match="pass guard=\\(\\) for none"):
        bare = Dispatcher(["cpu"], guard_triton=False)
    assert guard_module.installed() == ()
    bare.shutdown()
