import os

# Triton decides when it is first imported whether its language functions run under the interpreter: anything
# that imports triton during collection (torch.utils.flop_counter does) before a Triton test module set
# TRITON_INTERPRET would leave every interpreted kernel failing. On CPU the kernels run only interpreted.
if os.environ.get("ADAPT_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


from adapt.runtime import cpu_kernels

# Tests give many processes their own $ADAPT_CACHE; they all share one build of the fused CPU kernels (the
# one a user's runs on this machine use), so that it is compiled at most once per machine and source.
os.environ.setdefault(cpu_kernels.DIR_ENV, str(cpu_kernels.build_dir()))
