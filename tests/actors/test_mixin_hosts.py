"""Each mixin of a role sees the class it is mixed into only through its declared host protocol.

`Forwarding` (the inferencer's device side), `Scaling` (the supervisor's scale requests) and
`OpServer` (every role's request serving) use attributes their host class owns. Each module
declares those as a `typing.Protocol` (`ForwardHost`, `ScalingHost`, `OpServerHost`); read
from the source (ast), the members a mixin uses on ``self`` that it does not define itself are
exactly the protocol's, and the host class provides every one (a coroutine where the protocol's
is one). As `tests/actors/test_train_loop.py` does for the trainer's `LoopHost`.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

import pytest

from actors import handlers
from actors.inferencer import forward
from actors.supervisor import scaling

# (module, mixin, its host protocol, "module:host class")
MIXINS = [
    (forward, "Forwarding", "ForwardHost", "actors.inferencer.inferencer:Inferencer"),
    (scaling, "Scaling", "ScalingHost", "actors.supervisor.supervisor:Supervisor"),
    (handlers, "OpServer", "OpServerHost", "actors.runtime:Role"),
]


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _defined(cls: ast.ClassDef) -> set[str]:
    """Names a class body defines: methods and class attributes (annotated or assigned)."""
    out = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.Assign):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return out


def host_members_used(source: str, mixin: str) -> set[str]:
    """``self.X`` anywhere in the mixin's methods, less what the mixin defines itself."""
    cls = _class(ast.parse(source), mixin)
    used = {node.attr for node in ast.walk(cls)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"}
    return used - _defined(cls)


def declared(source: str, protocol: str) -> dict[str, bool]:
    """The protocol's members -> whether each is a coroutine method."""
    cls = _class(ast.parse(source), protocol)
    return {name: any(isinstance(n, ast.AsyncFunctionDef) and n.name == name for n in cls.body)
            for name in _defined(cls)}


def _assigned_on_self(klass: type) -> set[str]:
    """``self.X = ...`` (or ``+=``, annotated) anywhere in ``klass``'s own source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
    except (OSError, TypeError):  # a builtin base (object)
        return set()
    out = set()
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        out |= {t.attr for t in targets
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return out


def test_the_reader_finds_host_members():
    source = textwrap.dedent('''
        class Host(Protocol):
            cfg: Any
            async def wait(self) -> None: ...
            def say(self, text: str) -> None: ...

        class Mixin:
            LIMIT = 3
            def go(self):
                self.say(self.cfg.x)
                return self.own() + self.LIMIT
            async def run(self):
                await self.wait()
            def own(self):
                return 1
    ''')
    assert host_members_used(source, "Mixin") == {"cfg", "say", "wait"}
    assert declared(source, "Host") == {"cfg": False, "wait": True, "say": False}


@pytest.mark.parametrize("module,mixin,protocol,host", MIXINS, ids=[m[1] for m in MIXINS])
def test_the_protocol_lists_exactly_what_the_mixin_uses(module, mixin, protocol, host):
    source = Path(module.__file__).read_text()
    used = host_members_used(source, mixin)
    members = set(declared(source, protocol))
    assert used, f"{mixin} uses no host member: the reader is broken"
    assert not used - members, f"{mixin} uses host members {protocol} does not declare: {sorted(used - members)}"
    assert not members - used, f"{protocol} declares members {mixin} does not use: {sorted(members - used)}"


@pytest.mark.parametrize("module,mixin,protocol,host", MIXINS, ids=[m[1] for m in MIXINS])
def test_the_host_provides_the_protocol(module, mixin, protocol, host):
    import importlib

    mod_name, _, cls_name = host.partition(":")
    host_cls = getattr(importlib.import_module(mod_name), cls_name)
    mixin_cls = getattr(module, mixin)
    assert issubclass(host_cls, mixin_cls)
    # Not the mixin's own source: that it adds to a counter does not make the host own it.
    on_self = set().union(*(_assigned_on_self(k) for k in host_cls.__mro__ if k is not mixin_cls))
    for name, is_coroutine in declared(Path(module.__file__).read_text(), protocol).items():
        assert hasattr(host_cls, name) or name in on_self, f"{cls_name} has no {name} ({protocol})"
        if is_coroutine:
            assert inspect.iscoroutinefunction(getattr(host_cls, name)), f"{cls_name}.{name} is no coroutine"
