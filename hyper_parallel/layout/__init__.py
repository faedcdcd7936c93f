"""Where tensors live: placements, device meshes and layouts."""
from .layout import Layout
from .mesh import DeviceMesh, get_mesh, init_device_mesh
from .placement import Partial, Placement, Replicate, Shard

__all__ = ["Layout", "DeviceMesh", "get_mesh", "init_device_mesh", "Partial", "Placement", "Replicate", "Shard"]
