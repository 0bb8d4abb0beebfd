"""Bind and advertise addresses of agl_lab's HTTP servers (a leaf: imports nothing of agl_lab).

Each server agl_lab starts has two addresses: the host it **binds** (`127.0.0.1` by default:
nothing off this machine reaches it) and the host it **advertises** — what goes into the
URL it registers or hands out (the gateway's base URL given to runners and agents, the
engine endpoints registered with the gateway). They differ when a server binds a wildcard
(`0.0.0.0`, `::`): a wildcard is not an address a client can dial, so the advertised host is
then the machine's own address (`machine_address()`) unless one is configured.

| setting                                   | binds                         | advertises                      |
|-------------------------------------------|-------------------------------|---------------------------------|
| `agl_lab.server.host` / `advertise_host`  | the embedded store + gateway  | `trainer.base_url`, runners     |
| `agl_lab.serving.host` / `advertise_host` | the engine's OpenAI servers: the local engine's, and the verl CPU replicas' (each on its Ray node) | the endpoints registered with the gateway |

    advertised_host(bind, advertise)   the host to put in URLs
    url_host(host)                     `[v6]` for IPv6, the host otherwise
    is_loopback(host) / is_wildcard(host)
    engine_key(host, environ)          the key an engine's OpenAI server bound to `host` requires

**The engine's key.** An engine's OpenAI server bound beyond loopback (`agl_lab.serving.host`
not 127.0.0.1) answers only requests with `Authorization: Bearer $AGL_ENGINE_KEY`: otherwise
anyone who reaches the trainer host could generate with the training engine. The gateway
holds the same key (server setting `upstream_key`; `agl-lab serve` reads `AGL_ENGINE_KEY` or
`--engine-key-file`) and sends it upstream. A trainer whose environment has no key makes one
(`engine_key`) and puts it in its environment, where its embedded server, its Ray workers
and its verl CPU replicas read it; with a separate `agl-lab serve`, set the same
`AGL_ENGINE_KEY` on both hosts. On loopback no key is needed (and none is asked for).
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
from collections.abc import MutableMapping

LOOPBACK = "127.0.0.1"
WILDCARDS = ("0.0.0.0", "::", "")
ENGINE_KEY_ENV = "AGL_ENGINE_KEY"


def is_wildcard(host: str) -> bool:
    return host in WILDCARDS


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def machine_address() -> str:
    """This machine's address on its default route (no packet is sent), else its hostname's
    address, else loopback. The same rule as Ray's node IP (`ray.util.get_node_ip_address`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("8.8.8.8", 80))  # UDP connect: picks the route's source address, sends nothing
            return probe.getsockname()[0]
        except OSError:
            pass
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        return LOOPBACK
    return address


def advertised_host(bind: str, advertise: str | None = None) -> str:
    """The host a server bound to `bind` puts in its URLs: `advertise` when set, else `bind`,
    except that a wildcard bind advertises `machine_address()` (a wildcard is not dialable)."""
    if advertise:
        return str(advertise)
    return machine_address() if is_wildcard(bind) else bind


def url_host(host: str) -> str:
    """`host` as it goes into a URL: IPv6 literals in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def engine_key(host: str, environ: MutableMapping[str, str] | None = None) -> str:
    """The key an engine's OpenAI server bound to `host` requires: "" on loopback; else
    `$AGL_ENGINE_KEY`, or a fresh random key stored there (`environ`, default `os.environ`) so
    that the embedded server's gateway and the Ray workers started after it send the same one."""
    if is_loopback(host):
        return ""
    env = os.environ if environ is None else environ
    key = env.get(ENGINE_KEY_ENV, "")
    if key:
        return key
    env[ENGINE_KEY_ENV] = key = secrets.token_hex(16)
    return key
