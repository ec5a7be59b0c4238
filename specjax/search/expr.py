"""A tiny, safe expression evaluator for spec constraints (an AST whitelist, never `eval`).

Names are parameter names (dots allowed: `drafter.k`); inactive parameters evaluate to None.
Allowed: literals, names, arithmetic (+ - * / // % **), comparisons (incl. `in`), and/or/not,
if-else, and the functions min, max, abs.
"""

from __future__ import annotations

import ast
import operator

from specjax.errors import ConfigError

_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_CMP = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
        ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
        ast.NotIn: lambda a, b: a not in b}
_FUNCS = {"min": min, "max": max, "abs": abs}


def _dotted(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


class Expression:
    def __init__(self, text: str, known_names: set[str], where: str):
        self.text, self.where = text, where
        try:
            self.tree = ast.parse(text, mode="eval").body
        except SyntaxError as e:
            raise ConfigError(f"{where}: constraint {text!r} is not a valid expression: {e.msg}") from None
        self.names = set()
        self._check(self.tree, known_names)

    def _check(self, node, known):
        name = _dotted(node)
        if name is not None:
            if name not in known and name not in _FUNCS and name not in ("True", "False", "None"):
                raise ConfigError(f"{self.where}: constraint {self.text!r} names unknown parameter {name!r}")
            self.names.add(name)
            return
        allowed = (ast.Constant, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.IfExp, ast.Call,
                   ast.Tuple, ast.List, ast.operator, ast.unaryop, ast.boolop, ast.cmpop, ast.Load)
        if not isinstance(node, allowed):
            raise ConfigError(f"{self.where}: constraint {self.text!r} uses unsupported syntax "
                              f"{type(node).__name__}")
        if isinstance(node, ast.Call) and (_dotted(node.func) not in _FUNCS or node.keywords):
            raise ConfigError(f"{self.where}: constraint {self.text!r} may only call min, max, abs")
        for child in ast.iter_child_nodes(node):
            if isinstance(node, ast.Call) and child is node.func:
                continue
            self._check(child, known)

    def __call__(self, values: dict):
        return self._eval(self.tree, values)

    def _eval(self, node, v):
        name = _dotted(node)
        if name is not None:
            constants = {"True": True, "False": False, "None": None}
            return constants[name] if name in constants else v.get(name)
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.Tuple, ast.List)):
            return tuple(self._eval(e, v) for e in node.elts)
        if isinstance(node, ast.BinOp):
            return _BIN[type(node.op)](self._eval(node.left, v), self._eval(node.right, v))
        if isinstance(node, ast.UnaryOp):
            x = self._eval(node.operand, v)
            return {ast.Not: lambda: not x, ast.USub: lambda: -x, ast.UAdd: lambda: +x}[type(node.op)]()
        if isinstance(node, ast.BoolOp):
            if isinstance(node.op, ast.And):
                return all(self._eval(e, v) for e in node.values)
            return any(self._eval(e, v) for e in node.values)
        if isinstance(node, ast.Compare):
            left = self._eval(node.left, v)
            for op, comp in zip(node.ops, node.comparators):
                right = self._eval(comp, v)
                if not _CMP[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.IfExp):
            return self._eval(node.body, v) if self._eval(node.test, v) else self._eval(node.orelse, v)
        if isinstance(node, ast.Call):
            return _FUNCS[_dotted(node.func)](*(self._eval(a, v) for a in node.args))
        raise AssertionError(type(node))  # _check admitted nothing else

    def holds(self, values: dict) -> bool:
        try:
            return bool(self(values))
        except TypeError:  # e.g. comparing an inactive (None) parameter with a number
            return False
