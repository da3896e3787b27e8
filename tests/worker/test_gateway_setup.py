"""Setting up `score-worker gateway`: HTTPS through uvicorn's own TLS, keys from a file, and settings the
command refuses before it starts."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import httpx
import pytest
from gateway_kit import gateway_settings, serving_gateway
from secure_proxy import Pki
from worker_testkit import Names, client_kwargs, model_libraries_loaded_by

from worker.cli import EXIT_USAGE, main
from worker.environment import GatewaySettings
from worker.topics import create_missing_topics


def test_https_and_keys_from_a_file(kafka_bootstrap: str, pki: Pki, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# rotated monthly\nfile-key-a\n\n  file-key-b  \n")
    names = Names.unique("gateway-tls")
    asyncio.run(create_missing_topics(client_kwargs(kafka_bootstrap), [names.requests, names.results], 1, 1))
    settings = gateway_settings(
        kafka_bootstrap, names, gateway_api_keys=None, gateway_api_keys_file=keys,
        gateway_ssl_certfile=pki.server_cert, gateway_ssl_keyfile=pki.server_key,
    )  # fmt: skip
    assert settings.api_keys() == {"file-key-a", "file-key-b"}
    url = f"https://127.0.0.1:{settings.gateway_port}"
    trusted = ssl.create_default_context(cafile=str(pki.ca))
    with serving_gateway(settings), httpx.Client(base_url=url, verify=trusted) as https:
        assert https.get("/v1/models", headers={"Authorization": "Bearer file-key-b"}).status_code == 200
        refused = https.get("/v1/models", headers={"Authorization": "Bearer # rotated monthly"})
        assert refused.status_code == 401
        with pytest.raises(httpx.RemoteProtocolError):  # plain HTTP to the TLS port: no answer
            httpx.get(url.replace("https", "http") + "/health")
        with pytest.raises(httpx.ConnectError):  # a certificate nobody here trusts
            httpx.get(url + "/health", verify=ssl.create_default_context(cafile=str(pki.other_ca)))


def test_the_command_refuses_bad_settings_before_it_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SCORE_WORKER_BOOTSTRAP_SERVERS", raising=False)
    assert main(["gateway"]) == EXIT_USAGE
    assert "--bootstrap-servers" in capsys.readouterr().err
    assert (
        main(["gateway", "--bootstrap-servers", "h:1", "--api-keys-file", str(tmp_path / "none")])
        == EXIT_USAGE
    )
    assert "does not exist" in capsys.readouterr().err
    monkeypatch.setenv("SCORE_WORKER_GATEWAY_API_KEYS", "secret-never-shown")
    assert main(["gateway", "--bootstrap-servers", "h:1", "--port", "-5"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "SCORE_WORKER_GATEWAY_PORT" in err and "secret-never-shown" not in err
    assert GatewaySettings().api_keys() == {"secret-never-shown"}


def test_the_gateway_loads_no_model_library() -> None:
    """The `gateway` install has no torch: the command and its application must not import it, nor
    transformers (import-linter keeps the gateway off `models`, this checks what actually loads)."""
    assert model_libraries_loaded_by("worker.cli", "worker.gateway.app", "worker.gateway.command") == []
