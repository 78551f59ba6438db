"""The `dmdask` config: its defaults fit the schema, and the docs name every key there is."""
import os
import re

import jsonschema
import yaml

import dmdask

HERE = os.path.dirname(dmdask.__file__)


def _load(name):
    with open(os.path.join(HERE, name)) as f:
        return yaml.safe_load(f)


def _keys(settings, prefix=""):
    """The dotted keys of the settings (the leaves of nested mappings)."""
    for key, value in settings.items():
        yield from _keys(value, f"{prefix}{key}.") if isinstance(value, dict) else [prefix + key]


def _described(schema, prefix=""):
    """The dotted keys a schema describes (its objects' properties that are no objects)."""
    for key, value in schema["properties"].items():
        yield from _described(value, f"{prefix}{key}.") if "properties" in value else [prefix + key]


def test_defaults_fit_the_schema_and_every_key_is_described():
    defaults, schema = _load("dmdask.yaml"), _load("dmdask-schema.yaml")
    jsonschema.validate(defaults, schema)
    assert set(_keys(defaults)) == set(_described(schema))
    bad = dict(defaults["dmdask"], worker=dict(defaults["dmdask"]["worker"], **{"read-thread": 4}))
    try:
        jsonschema.validate({"dmdask": bad}, schema)
    except jsonschema.ValidationError as exc:
        assert "read-thread" in str(exc)
    else:
        raise AssertionError("a misspelt key passed the schema")


def test_the_docs_configuration_row_names_exactly_the_keys_of_dmdask_yaml():
    with open(os.path.join(HERE, "..", "docs", "architecture.md")) as f:
        row = next(line for line in f if line.startswith("| Configuration |"))
    named = {f"dmdask.{group}{key.strip()}" for group, keys in re.findall(r"`dmdask\.([\w.-]*?)\{([^}]*)\}`", row)
             for key in keys.split(",")}
    assert named == {f"dmdask.{key}" for key in _keys(_load("dmdask.yaml")["dmdask"])}


def test_the_default_store_deadlines_leave_a_hung_request_room_to_be_retried():
    """A hung request is cut after `read-seconds`, then retried within `retry-seconds`: with
    the two equal (30 s each, before), one hung request failed its block after 1 try (the
    fault benchmark measured it); the defaults keep at least two tries' room."""
    store = _load("dmdask.yaml")["dmdask"]["store"]
    assert 2 * store["read-seconds"] <= store["retry-seconds"], store
