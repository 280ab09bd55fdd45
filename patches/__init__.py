"""coat_patches: what makes COAT work inside Megatron-LM without editing it.

Installed as the package ``coat_patches`` (the folder is ``patches/``).
"""
