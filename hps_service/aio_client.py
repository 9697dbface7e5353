"""The asyncio client, re-exported from ``hps_client`` so ``from hps_service.aio_client import AsyncHPSClient``
keeps working."""

from hps_client.aio import AsyncHPSClient

__all__ = ["AsyncHPSClient"]
