"""Everything that depends on the torch version or on torch internals, one module per torch area.

Supported: torch 2.11 and 2.12. The rest of the package reaches private torch surface only
through the names below; each states what it relies on, and ``tests/compat/test_compat.py`` checks each
one, so a torch upgrade that moves something fails there, in a test named after the cause.

* ``aot``: building the aot_autograd backend, the partitioner, and the conventions of the graphs
  aot_autograd hands over (input order, names of saved inputs, gradient positions, recompute tags);
* ``inductor``: the inner compiler, its decompositions and joint-graph passes, buffer protection;
* ``dynamo``: registering the ``"deepcompile"`` backend name, the fake values of Dynamo's graphs,
  which frames Dynamo compiles;
* ``fx``: operator schemas, recorded eager inputs, side-effect registration, pytree;
* ``modules``: a module's own parameters and buffers; swapping a registered parameter for a gathered tensor;
* ``tensors``: multi-tensor (foreach) kernels, storage identity, storages that refuse reads;
* ``streams``: wrapping a stream the C++ runtime created as a torch stream object;
* ``distributed``: the key-value store of the default process group;
* ``hub_kernels``: the routing wrappers of Hugging Face's ``kernels`` package (transformers >= 5.25),
  which keep Dynamo from tracing checkpointed layers.
"""

from __future__ import annotations

import torch

from deepcompile.compat.aot import (
    aot_backend,
    boxed,
    forward_inputs,
    gradient_output_index,
    is_incoming_gradient,
    joint_primal_inputs,
    mark_boxed,
    mark_must_recompute,
    min_cut_partition,
    partition_forward_output_count,
    save_forward_input_for_backward,
    saved_forward_inputs,
)
from deepcompile.compat.distributed import default_store
from deepcompile.compat.dynamo import (
    never_compile_as_frame,
    register_backend,
    set_traced_value,
    traced_value,
    will_compile_frame,
)
from deepcompile.compat.fx import (
    eager_input_vals,
    is_higher_order_op,
    is_op_overload,
    lazy_graph_module,
    mark_ops_side_effectful,
    node_position,
    operator_namespace,
    overload_packet_name,
    returns_view_of_input,
    set_eager_input_vals,
    tree_leaves,
    tree_map_only,
)
from deepcompile.compat.inductor import (
    compiled_output_strides,
    inductor_compile,
    inductor_compiler_for_later,
    inductor_decompositions,
    inductor_joint_graph_passes,
    protect_runtime_buffers_in_inductor,
)
from deepcompile.compat.hub_kernels import bypass_idle_kernel_routing, kernel_routed_modules
from deepcompile.compat.modules import (
    direct_buffers,
    direct_parameters,
    drop_module_compile,
    share_always_called_hooks,
    swap_parameter,
)
from deepcompile.compat.streams import stream_from_ids
from deepcompile.compat.tensors import (
    forbid_data_access,
    foreach_mul_,
    foreach_norm,
    shares_storage,
    storage_id,
    storage_object,
    weak_id_key_dictionary,
)

TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])

__all__ = [
    "TORCH_VERSION",
    "aot_backend",
    "boxed",
    "bypass_idle_kernel_routing",
    "compiled_output_strides",
    "default_store",
    "direct_buffers",
    "direct_parameters",
    "eager_input_vals",
    "forbid_data_access",
    "foreach_mul_",
    "foreach_norm",
    "forward_inputs",
    "gradient_output_index",
    "inductor_compile",
    "inductor_compiler_for_later",
    "inductor_decompositions",
    "inductor_joint_graph_passes",
    "is_incoming_gradient",
    "is_higher_order_op",
    "is_op_overload",
    "joint_primal_inputs",
    "kernel_routed_modules",
    "lazy_graph_module",
    "mark_boxed",
    "mark_must_recompute",
    "mark_ops_side_effectful",
    "min_cut_partition",
    "never_compile_as_frame",
    "node_position",
    "partition_forward_output_count",
    "operator_namespace",
    "overload_packet_name",
    "protect_runtime_buffers_in_inductor",
    "register_backend",
    "returns_view_of_input",
    "save_forward_input_for_backward",
    "saved_forward_inputs",
    "set_eager_input_vals",
    "set_traced_value",
    "shares_storage",
    "storage_id",
    "storage_object",
    "stream_from_ids",
    "drop_module_compile",
    "share_always_called_hooks",
    "swap_parameter",
    "tree_leaves",
    "traced_value",
    "tree_map_only",
    "weak_id_key_dictionary",
    "will_compile_frame",
]
