"""The fake decoder under its former name, for the launcher's tests (tests/launcher) that import it from here."""
from epd_bench.proxy_servers import FakeDecoder

__all__ = ["FakeDecoder"]
