"""Where the rendezvous table is and how to authenticate: ``--rdzv-endpoint`` and credentials.

- ``parse_endpoint``: ``--rdzv-endpoint`` -> ``TableEndpoint`` (or an error naming the fix).
- ``resolve_credential``: the documented credential order, from an explicit environment mapping.

This module and ``_auth`` (the state key) are the only ones of the package that read
environment variables.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional
from urllib.parse import urlsplit

DEFAULT_TABLE = "torchrendezvous"
ENV_CONNECTION_STRING = "AZURE_STORAGE_CONNECTION_STRING"
ENV_ACCOUNT_NAME = "AZURE_STORAGE_ACCOUNT_NAME"
ENV_ACCOUNT_KEY = "AZURE_STORAGE_ACCOUNT_KEY"
ENV_ACCOUNT_KEY_ALIAS = "AZURE_STORAGE_KEY"  # the Azure CLI's name for the same thing
ENV_SAS_TOKEN = "AZURE_STORAGE_SAS_TOKEN"
_TABLE_RE = re.compile(r"^[A-Za-z][A-Za-z0-9]{2,62}$")
_ACCOUNT_RE = re.compile(r"^[a-z0-9]{3,24}$")
_ENDPOINT_HELP = (
    "pass --rdzv-endpoint=https://<account>.table.core.windows.net[/<table>] (or just <account>); "
    "for Azurite: --rdzv-endpoint=http://127.0.0.1:10002/devstoreaccount1"
)
CREDENTIAL_HELP = (
    f"set {ENV_CONNECTION_STRING}, or {ENV_ACCOUNT_KEY} (the account key), or {ENV_SAS_TOKEN} "
    "(a SAS with table read/add/update/delete/query), or sign in for DefaultAzureCredential "
    "(managed identity, workload identity, `az login`) with the 'Storage Table Data Contributor' role"
)


@dataclass(frozen=True)
class TableEndpoint:
    """Where the rendezvous table lives: ``account_url`` (no table) plus ``table``."""

    account_url: str
    account: str
    table: str

    @property
    def is_https(self) -> bool:
        return self.account_url.startswith("https://")


def _is_local_host(host: str) -> bool:
    if host in ("localhost", "host.docker.internal"):
        return True
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _is_private_host(host: str) -> bool:
    """Loopback, a Docker host alias or a private/link-local address: where an emulator runs."""
    if host in ("localhost", "host.docker.internal"):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_private or ip.is_link_local


def parse_endpoint(endpoint: str, table: Optional[str] = None) -> TableEndpoint:
    """Parse ``--rdzv-endpoint``; ``table`` (from ``--rdzv-conf table=...``) wins over the URL's.

    Accepted: ``https://<account>.table.<cloud suffix>[/<table>]``, a bare ``<account>[/<table>]``,
    and path-style emulator URLs ``http://<ip or localhost>:<port>/<account>[/<table>]``.
    """
    raw = (endpoint or "").strip()
    if not raw:
        raise ValueError(f"the azure-table rendezvous needs an endpoint: {_ENDPOINT_HELP}")
    if "://" not in raw:
        account, _, url_table = raw.partition("/")
        if not _ACCOUNT_RE.match(account):
            raise ValueError(
                f"--rdzv-endpoint={raw!r} is not an Azure Table URL or storage account name "
                f"(host:port endpoints belong to --rdzv-backend=c10d); {_ENDPOINT_HELP}"
            )
        return _finish(f"https://{account}.table.core.windows.net", account, url_table, table, raw)
    parts = urlsplit(raw)
    if parts.query or parts.fragment:
        raise ValueError(
            "--rdzv-endpoint must not carry a query string: a SAS token on the command line is "
            f"logged by torchrun and visible in `ps`; {CREDENTIAL_HELP}"
        )
    host = (parts.hostname or "").lower()
    if parts.scheme not in ("http", "https") or not host:
        raise ValueError(f"--rdzv-endpoint={raw!r} is not an http(s) URL; {_ENDPOINT_HELP}")
    if parts.scheme == "http" and not _is_private_host(host):
        raise ValueError(
            f"--rdzv-endpoint={raw!r} uses plain http to {host}, a public host: the request "
            "signatures and the rendezvous rows would cross the network in clear. Use https "
            "(http is accepted only for emulators on loopback or private addresses)"
        )
    segments = [s for s in parts.path.split("/") if s]
    labels = host.split(".")
    if _is_local_host(host):
        if not segments:
            raise ValueError(
                f"--rdzv-endpoint={raw!r}: an emulator URL names the account in its path, "
                f"e.g. http://127.0.0.1:10002/devstoreaccount1"
            )
        account, rest = segments[0], segments[1:]
        base = f"{parts.scheme}://{parts.netloc}/{account}"
    elif len(labels) > 2 and labels[1] == "table":
        account, rest = labels[0], segments
        base = f"{parts.scheme}://{parts.netloc}"
    elif len(labels) > 2 and labels[1] in ("blob", "dfs", "queue", "file"):
        raise ValueError(
            f"--rdzv-endpoint={raw!r} is the {labels[1]} service of account {labels[0]!r}; the "
            f"rendezvous uses its table service: https://{labels[0]}.table.core.windows.net"
        )
    else:
        raise ValueError(f"--rdzv-endpoint={raw!r} is not an Azure Table endpoint; {_ENDPOINT_HELP}")
    if len(rest) > 1:
        raise ValueError(f"--rdzv-endpoint={raw!r}: expected at most one path segment (the table name)")
    return _finish(base, account, rest[0] if rest else "", table, raw)


def _finish(base: str, account: str, url_table: str, table: Optional[str], raw: str) -> TableEndpoint:
    name = table or url_table or DEFAULT_TABLE
    if not _TABLE_RE.match(name):
        raise ValueError(
            f"table name {name!r} (from {raw!r}) is invalid: Azure table names are 3-63 letters "
            f"and digits starting with a letter, e.g. {DEFAULT_TABLE}"
        )
    return TableEndpoint(account_url=base, account=account, table=name)


# -- credentials ---------------------------------------------------------------------------------
def _parse_connection_string(conn: str) -> dict:
    fields = {}
    for part in conn.split(";"):
        key, sep, value = part.partition("=")
        if sep:
            fields[key.strip().lower()] = value.strip()
    return fields


def require_sdk() -> None:
    """Fail with the install command when the Azure SDK (an optional dependency) is missing."""
    try:
        import azure.core  # noqa: F401
        import azure.data.tables  # noqa: F401
    except ImportError:
        raise ImportError(
            "the azure-table rendezvous needs azure-data-tables: pip install 'raylastic[azure]'"
        ) from None


def resolve_credential(endpoint: TableEndpoint, environ: Optional[Mapping[str, str]] = None):
    """Return ``(credential, source)`` in the documented order; ``source`` names no secret.

    1. ``AZURE_STORAGE_CONNECTION_STRING`` (its AccountKey or SharedAccessSignature),
    2. ``AZURE_STORAGE_ACCOUNT_KEY`` (or ``AZURE_STORAGE_KEY``): shared key of the endpoint's account,
    3. ``AZURE_STORAGE_SAS_TOKEN``,
    4. ``azure.identity.DefaultAzureCredential`` (https endpoints only).

    The same variables as raylastic's checkpoint storage; ``AZURE_STORAGE_ACCOUNT_NAME``, when
    set, must name the endpoint's account.
    """
    require_sdk()
    from azure.core.credentials import AzureNamedKeyCredential, AzureSasCredential

    env = os.environ if environ is None else environ
    named = env.get(ENV_ACCOUNT_NAME, "").strip()
    if named and endpoint.account and named != endpoint.account:
        raise ValueError(
            f"{ENV_ACCOUNT_NAME}={named!r} but --rdzv-endpoint names account {endpoint.account!r}: "
            "point the endpoint at the same account or unset the variable"
        )
    conn = env.get(ENV_CONNECTION_STRING, "").strip()
    if conn:
        fields = _parse_connection_string(conn)
        name = fields.get("accountname")
        if name and endpoint.account and name != endpoint.account:
            raise ValueError(
                f"{ENV_CONNECTION_STRING} is for account {name!r} but --rdzv-endpoint names account "
                f"{endpoint.account!r}: point the endpoint at the same account or unset the variable"
            )
        if fields.get("accountkey"):
            return AzureNamedKeyCredential(name or endpoint.account, fields["accountkey"]), ENV_CONNECTION_STRING
        if fields.get("sharedaccesssignature"):
            return AzureSasCredential(fields["sharedaccesssignature"].lstrip("?")), ENV_CONNECTION_STRING
        raise ValueError(f"{ENV_CONNECTION_STRING} has neither AccountKey nor SharedAccessSignature")
    key = env.get(ENV_ACCOUNT_KEY, "").strip() or env.get(ENV_ACCOUNT_KEY_ALIAS, "").strip()
    if key:
        if not endpoint.account:
            raise ValueError(f"{ENV_ACCOUNT_KEY} needs the account name in --rdzv-endpoint")
        return AzureNamedKeyCredential(endpoint.account, key), ENV_ACCOUNT_KEY
    sas = env.get(ENV_SAS_TOKEN, "").strip()
    if sas:
        return AzureSasCredential(sas.lstrip("?")), ENV_SAS_TOKEN
    if not endpoint.is_https:
        raise ValueError(
            f"no storage credentials for {endpoint.account_url} (Entra ID tokens need https): {CREDENTIAL_HELP}"
        )
    try:
        from azure.identity import DefaultAzureCredential
    except ImportError:
        raise ValueError(
            f"no storage credentials found and azure-identity is not installed: {CREDENTIAL_HELP}, "
            "or `pip install azure-identity`"
        ) from None
    return DefaultAzureCredential(), "DefaultAzureCredential"
