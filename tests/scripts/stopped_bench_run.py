"""bench.run with three fake sections: `first` measures a row at once, `blocks` waits
until the run is stopped, `third` would measure another. Arguments go to bench.run."""

import importlib.machinery
import os
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench import run
from bench.common import compare


def section(name, fn):
    module = types.ModuleType(f"bench.{name}")
    module.__spec__ = importlib.machinery.ModuleSpec(f"bench.{name}", None)
    module.run = fn
    sys.modules[f"bench.{name}"] = module


def blocks(ctx):
    ctx.progress("blocking until stopped")
    while True:
        time.sleep(0.05)


section("first", lambda ctx: [compare("first", "figure", 1.0, "us", "alt", 4.0, "<= 0.25")])
section("blocks", blocks)
section("third", lambda ctx: [compare("third", "other", 1.0, "us", "alt", 4.0)])
run.SECTIONS = {"first": 1, "blocks": 1, "third": 1}
sys.exit(run.main(sys.argv[1:]))
