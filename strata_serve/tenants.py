"""How a conversation key names its tenant: the core owns the format, plugins call these.

With named API keys the core prefixes every conversation key with the tenant's name
(``alice--<key>``). Tenant names have no ``-`` and a plugin's key may not contain
``--``, so no key reaches another tenant's namespace. The plain ``server.api_key``
(and, without keys, everyone) is the unnamed tenant (None): its keys have no prefix.
"""

from __future__ import annotations

#: Separates a tenant's name from its conversation keys.
TENANT_SEPARATOR = "--"


def tenant_key(tenant: str | None, key: str) -> str:
    """The key ``tenant``'s conversation ``key`` (a keying plugin's answer) has in the core."""
    return key if tenant is None else f"{tenant}{TENANT_SEPARATOR}{key}"


def tenant_of(key: str) -> str | None:
    """The tenant whose conversation ``key`` is (None: the unnamed tenant)."""
    tenant, separator, _ = key.partition(TENANT_SEPARATOR)
    return tenant if separator else None


def in_tenant(key: str, tenant: str | None) -> bool:
    """Whether the conversation ``key`` belongs to ``tenant`` (None: the unnamed tenant)."""
    return tenant_of(key) == tenant
