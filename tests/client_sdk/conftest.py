"""The SDK's tests run against a real server: the same fixtures as tests/server's."""

from tests.server.conftest import auth_server, client, redis_server, serve_app, server  # noqa: F401 - fixtures
