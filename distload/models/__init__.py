"""Reference tensor-parallel forward over the serving layout, used to verify loaded shards."""

from distload.models.forward import FAMILIES, Family, family_of, forward

__all__ = ["FAMILIES", "Family", "family_of", "forward"]
