"""coat_patches: what makes COAT work inside Megatron-LM's training loop without editing it.

The package ``coat_patches`` (``patches/coat_patches/``). ``coat-megatron-run``
(``launch``) runs a pretrain script inside ``install.coat_megatron_patches()``, which applies one
module per patch: ``arguments`` (``--coat-fp8`` and the ``--coat-*`` knobs), ``model`` (the COAT
layer spec), ``optimizer`` (the FP8 distributed optimizer), ``report`` (``--coat-report``),
``wheel`` (start-up from the megatron-core wheel) and, without a GPU, ``training_cpu``
(Megatron's training loop on a CPU, on top of ``cpu``: megatron-core on a CPU). ``demo`` is the
main job (``coat-megatron-demo``). Importing this package imports nothing else.
"""
