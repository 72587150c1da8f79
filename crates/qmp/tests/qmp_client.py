#!/usr/bin/env python3
"""QMP checks run by tests/qemu_client.rs against fusex-qmp's qmp_demo and, when installed,
against qemu-storage-daemon.

    qmp_client.py SOCKET          protocol-level checks; prints what was observed as JSON
    qmp_client.py --demo SOCKET   the same, then qemu.qmp's QMPClient against the demo's commands
                                  (asserting the answers), and finally `quit`

The protocol-level part records only what fusex and QEMU should agree on (error classes and
texts, message shapes), so the Rust test can compare the two JSON reports key by key. It talks
raw JSON over the socket, because QEMU's client library refuses to send malformed input.
"""

import asyncio
import json
import sys
import time

from qemu.qmp import ExecuteError, QMPClient

TIMEOUT = 5


class Raw:
    """A bare QMP connection: send text, read one JSON line."""

    async def open(self, path):
        self.r, self.w = await asyncio.open_unix_connection(path, limit=1 << 22)
        return self

    async def recv(self):
        line = await asyncio.wait_for(self.r.readline(), TIMEOUT)
        if not line:
            raise EOFError("server closed the connection")
        return json.loads(line)

    async def send(self, text):
        self.w.write(text.encode() + b"\n")
        await self.w.drain()

    async def ask(self, text):
        await self.send(text)
        return await self.recv()

    async def close(self):
        self.w.close()
        try:
            await self.w.wait_closed()
        except (ConnectionError, BrokenPipeError):
            pass


def err(reply):
    """[class, desc, id or None] of an error reply; fails on a success reply."""
    assert "error" in reply, f"expected an error, got {reply}"
    return [reply["error"]["class"], reply["error"]["desc"], reply.get("id")]


def kind(v):
    return type(v).__name__


async def protocol_checks(path):
    obs = {}
    c = await Raw().open(path)
    g = await c.recv()
    q = g["QMP"]
    obs["greeting"] = {
        "keys": sorted(g.keys()),
        "QMP keys": sorted(q.keys()),
        "version keys": sorted(q["version"].keys()),
        "qemu keys and types": {k: kind(v) for k, v in sorted(q["version"]["qemu"].items())},
        "package type": kind(q["version"]["package"]),
        "capabilities type": kind(q["capabilities"]),
    }

    # Capabilities negotiation mode.
    obs["negotiation: other command"] = err(await c.ask('{"execute": "query-version", "id": 1}'))
    obs["negotiation: unknown command"] = err(await c.ask('{"execute": "no-such-command", "id": "u"}'))
    obs["negotiation: missing execute"] = err(await c.ask('{"arguments": {}}'))
    obs["negotiation: unexpected argument"] = err(
        await c.ask('{"execute": "qmp_capabilities", "arguments": {"foo": 1}}'))
    obs["negotiation: enable not a list"] = err(
        await c.ask('{"execute": "qmp_capabilities", "arguments": {"enable": "oob"}}'))
    obs["negotiation: unknown capability"] = err(
        await c.ask('{"execute": "qmp_capabilities", "arguments": {"enable": ["nope"]}}'))
    obs["negotiation: success"] = await c.ask('{"execute": "qmp_capabilities", "id": "neg"}')

    # Command mode.
    obs["again qmp_capabilities"] = err(await c.ask('{"execute": "qmp_capabilities", "id": 2}'))
    obs["unknown command"] = err(await c.ask('{"execute": "no-such-command", "id": 3}'))
    bad = err(await c.ask("xyz"))
    obs["bad JSON"] = [bad[0], bad[1].split(",")[0] + ",", bad[2]]
    obs["duplicate key"] = err(await c.ask('{"execute": "query-version", "execute": "x"}'))
    obs["not an object"] = err(await c.ask("[1]"))
    obs["null"] = err(await c.ask("null"))
    obs["missing execute"] = err(await c.ask('{"id": 5}'))
    obs["execute not a string"] = err(await c.ask('{"execute": 1, "id": 6}'))
    obs["arguments not an object"] = err(await c.ask('{"execute": "query-version", "arguments": [], "id": 7}'))
    obs["unexpected member"] = err(await c.ask('{"execute": "query-version", "foo": 1, "id": 8}'))
    obs["exec-oob"] = err(await c.ask('{"exec-oob": "query-version", "id": 9}'))
    obs["query-version argument"] = err(
        await c.ask('{"execute": "query-version", "arguments": {"x": 1}}'))
    v = await c.ask('{"execute": "query-version", "id": {"any": ["json", 1, null]}}')
    obs["query-version"] = {
        "keys": sorted(v.keys()),
        "id": v["id"],
        "return keys": sorted(v["return"].keys()),
        "qemu types": {k: kind(x) for k, x in sorted(v["return"]["qemu"].items())},
        "same as greeting": v["return"] == q["version"],
    }
    cmds = await c.ask('{"execute": "query-commands"}')
    names = [e["name"] for e in cmds["return"]]
    obs["query-commands"] = {
        "keys": sorted(cmds.keys()),
        "entry keys": sorted({k for e in cmds["return"] for k in e}),
        "builtins listed": sorted(n for n in names if n in ("qmp_capabilities", "query-version", "query-commands")),
        "no duplicates": len(names) == len(set(names)),
    }
    # Framing: two requests on one line, and one request over two lines.
    await c.send('{"execute": "query-version", "id": "a"} {"execute": "query-version", "id": "b"}')
    obs["two on one line"] = [(await c.recv())["id"], (await c.recv())["id"]]
    await c.send('{"execute": "query-version",')
    obs["one over two lines"] = sorted((await c.ask('"id": "split"}')).keys())
    await c.close()
    return obs


def expect_error(e, cls, desc):
    assert e.error_class == cls, f"{e.error_class} != {cls}"
    assert e.error.error.desc == desc, f"{e.error.error.desc!r} != {desc!r}"


async def client_checks(path):
    """qemu.qmp's QMPClient against qmp_demo: negotiation, built-ins, demo commands with good and
    bad arguments, events broadcast to two clients."""
    a = QMPClient("fusex-a")
    b = QMPClient("fusex-b")
    await a.connect(path)
    await b.connect(path)
    assert a.greeting.QMP.capabilities == [], a.greeting
    ver = await a.execute("query-version")
    assert ver["package"].startswith("fusex "), ver
    names = [c["name"] for c in await a.execute("query-commands")]
    assert names == ["qmp_capabilities", "query-version", "query-commands",
                     "demo-echo", "demo-event", "demo-fail", "quit"], names

    assert await a.execute("demo-echo", {"message": "hi", "repeat": 3}) == {"message": "hihihi"}
    assert await a.execute("demo-echo", {"message": "x,y"}) == {"message": "x,y"}
    for args, cls, desc in [
        ({}, "GenericError", "Parameter 'message' is missing"),
        ({"message": "m", "extra": 1}, "GenericError", "Parameter 'extra' is unexpected"),
        ({"message": 5}, "GenericError", "Invalid parameter type for 'message', expected: string"),
        ({"message": "m", "repeat": "2"}, "GenericError", "Invalid parameter type for 'repeat', expected: integer"),
        ({"message": "m", "repeat": 300}, "GenericError", "Parameter 'repeat' expects uint8"),
    ]:
        try:
            await a.execute("demo-echo", args)
        except ExecuteError as e:
            expect_error(e, cls, desc)
        else:
            raise AssertionError(f"demo-echo {args} succeeded")
    try:
        await a.execute("demo-fail")
    except ExecuteError as e:
        expect_error(e, "DeviceNotFound", "Demo device 'nothing' not found")
    else:
        raise AssertionError("demo-fail succeeded")
    try:
        await a.execute("no-such-command")
    except ExecuteError as e:
        expect_error(e, "CommandNotFound", "The command no-such-command has not been found")
    else:
        raise AssertionError("no-such-command succeeded")

    # An event reaches both clients, stamped now.
    before = time.time()
    assert await a.execute("demo-event", {"name": "first"}) == {}
    for client in (a, b):
        ev = await asyncio.wait_for(client.events.get(), TIMEOUT)
        assert ev["event"] == "DEMO_EVENT", ev
        assert ev["data"] == {"count": 1, "name": "first"}, ev
        stamp = ev["timestamp"]["seconds"] + ev["timestamp"]["microseconds"] / 1e6
        assert before - 1 <= stamp <= time.time() + 1, (before, stamp)
    assert await b.execute("demo-event") == {}
    ev = await asyncio.wait_for(a.events.get(), TIMEOUT)
    assert ev["data"] == {"count": 2}, ev

    # A client that has not negotiated gets no event (raw: QMPClient always negotiates).
    raw = await Raw().open(path)
    await raw.recv()
    await a.execute("demo-event")
    await asyncio.wait_for(a.events.get(), TIMEOUT)
    reply = await raw.ask('{"execute": "qmp_capabilities", "id": "late"}')
    assert reply == {"return": {}, "id": "late"}, f"an event reached a negotiating client: {reply}"
    # ... and capabilities fusex does not offer cannot be enabled.
    raw2 = await Raw().open(path)
    await raw2.recv()
    assert err(await raw2.ask('{"execute": "qmp_capabilities", "arguments": {"enable": ["oob"]}}')) == \
        ["GenericError", "Capability oob not available", None]
    await raw2.close()

    await b.disconnect()
    assert await a.execute("quit") == {}
    try:
        await a.disconnect()
    except EOFError:
        pass  # the server closed first, as QEMU does after quit
    try:
        await raw.recv()
    except (EOFError, ConnectionError):
        pass
    else:
        raise AssertionError("the connection outlived quit")
    await raw.close()


async def main():
    demo = sys.argv[1] == "--demo"
    path = sys.argv[-1]
    obs = await protocol_checks(path)
    if demo:
        await client_checks(path)
    print(json.dumps(obs, indent=1, sort_keys=True))


if __name__ == "__main__":
    asyncio.run(main())
