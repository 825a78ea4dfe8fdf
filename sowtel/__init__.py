"""sowtel: observability for JAX."""

from sowtel.capture import save_intermediates
from sowtel.primitive import at_step, sow
from sowtel.records import Record

__all__ = ["Record", "at_step", "save_intermediates", "sow"]
