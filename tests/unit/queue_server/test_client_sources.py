"""Who a caller is and where it is from (issue 39, finding 2): both APIs
name a caller's host alike (gRPC's "ipv4:H:P" and "ipv6:[H]:P" as HTTP's
"H"), a registration's rate is counted per /24 or /64, a proxy's
X-Forwarded-For is believed only from trusted proxies, and a limited
registration says when to come back."""

from __future__ import annotations

import asyncio

import pytest

from queue_server.auth import Caller, RateLimit, RateLimited, TrustedProxies, peer_host, rate_key
from queue_server.config import QueueConfig
from queue_server.server import QueueServer
from roadlog.runtime.config import ConfigError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("peer", "host"),
    [
        ("ipv4:10.1.2.3:5555", "10.1.2.3"),
        ("ipv6:[2001:db8::7]:5555", "2001:db8::7"),
        ("ipv6:%5B2001:db8::7%5D:5555", "2001:db8::7"),
        ("10.1.2.3", "10.1.2.3"),  # HTTP's remote
        ("2001:db8::7", "2001:db8::7"),
        ("[::1]", "::1"),
    ],
)
def test_both_apis_name_a_callers_host_alike(peer: str, host: str) -> None:
    assert peer_host(peer) == host


def test_a_rate_counts_a_v4_caller_by_its_24_and_a_v6_one_by_its_64() -> None:
    assert rate_key("10.1.2.3") == rate_key("10.1.2.250") == "10.1.2.0/24"
    assert rate_key("10.1.3.3") != rate_key("10.1.2.3")
    assert rate_key("2001:db8:0:1::5") == rate_key("2001:db8:0:1:ffff::9") == "2001:db8:0:1::/64"
    assert rate_key("::ffff:10.1.2.3") == "10.1.2.0/24"
    assert rate_key("not-an-address") == "not-an-address"


def test_x_forwarded_for_is_believed_only_from_a_trusted_proxy() -> None:
    proxies = TrustedProxies(["10.0.0.0/8", "::1/128"])
    assert proxies.client("10.0.0.5", "203.0.113.9") == "203.0.113.9"
    # The proxy appends: the last address not a proxy's is the caller (a
    # client's own forged entries stand before it).
    assert proxies.client("10.0.0.5", "198.51.100.1, 203.0.113.9, 10.0.0.4") == "203.0.113.9"
    assert proxies.client("203.0.113.9", "198.51.100.1") == "203.0.113.9"  # not a proxy: ignored
    assert proxies.client("::1", "2001:db8::1") == "2001:db8::1"
    assert TrustedProxies().client("10.0.0.5", "203.0.113.9") == "10.0.0.5"  # none trusted
    with pytest.raises(ConfigError, match="trusted_proxies"):
        QueueConfig(trusted_proxies=["10.0.0.0/33"], insecure=True).validate()


def test_a_limited_rate_says_when_to_come_back() -> None:
    now = [0.0]
    limit = RateLimit(6, clock=lambda: now[0])  # one every 10 s
    for _ in range(6):
        assert limit.take("k")
    assert not limit.take("k")
    assert limit.retry_after("k") == pytest.approx(10.0)
    now[0] += 4.0
    assert limit.retry_after("k") == pytest.approx(6.0)
    assert limit.retry_after("other") == 0.0


def test_registrations_from_one_24_share_one_rate_whatever_the_address_or_api() -> None:
    async def main() -> None:
        qs = QueueServer(QueueConfig(registrations_per_minute=3, insecure=True))
        # Over HTTP (a plain host) and gRPC (caller_of makes the same plain host).
        for host in ("198.51.100.1", "198.51.100.2", "198.51.100.3"):
            with pytest.raises(Exception) as e:  # past the rate: the call goes on to the cluster
                await qs.client_call("RegisterClient", b"", 0.01, Caller(None, host))
            assert not isinstance(e.value, RateLimited), e.value
        with pytest.raises(RateLimited) as limited:
            await qs.client_call("RegisterClient", b"", 0.01, Caller(None, "198.51.100.77"))
        assert "198.51.100.0/24" in limited.value.message and limited.value.retry_after_s > 0
        with pytest.raises(Exception) as other:  # another /24 has its own
            await qs.client_call("RegisterClient", b"", 0.01, Caller(None, "198.51.101.1"))
        assert not isinstance(other.value, RateLimited)

    asyncio.run(main())
