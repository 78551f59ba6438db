"""Test helpers for dmdask (e.g. a stand-in shared store served over HTTP)."""
