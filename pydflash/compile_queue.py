"""Placeholder until the compile queue lands."""


def stats() -> dict:
    return {}
