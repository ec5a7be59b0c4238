"""YAML loading that remembers where each key was written, so spec errors can name file:line."""

from __future__ import annotations

import yaml

from specjax.errors import ConfigError


class LineDict(dict):
    """A dict from YAML that knows its own line and the line of each key (1-based)."""

    line: int = 0
    key_lines: dict

    def line_of(self, key) -> int:
        return self.key_lines.get(key, self.line)


class _Loader(yaml.SafeLoader):
    pass


def _construct_mapping(loader, node, deep=False):
    loader.flatten_mapping(node)
    out = LineDict()
    out.line = node.start_mark.line + 1
    out.key_lines = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in out:
            raise ConfigError(f"line {key_node.start_mark.line + 1}: duplicate key {key!r}")
        out[key] = loader.construct_object(value_node, deep=True)
        out.key_lines[key] = key_node.start_mark.line + 1
    return out


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_yaml(path: str) -> LineDict:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"{path}: spec file not found") from None
    except OSError as e:
        raise ConfigError(f"{path}: unreadable: {e}") from None
    try:
        data = yaml.load(text, Loader=_Loader)
    except ConfigError as e:
        raise ConfigError(f"{path}:{e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        raise ConfigError(f"{where}: invalid YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, LineDict):
        raise ConfigError(f"{path}: a spec must be a YAML mapping at the top level")
    return data
