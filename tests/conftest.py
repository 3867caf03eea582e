import os

from adapt.runtime import cpu_kernels

# Tests give many processes their own $ADAPT_CACHE; they all share one build of the fused CPU kernels (the
# one a user's runs on this machine use), so that it is compiled at most once per machine and source.
os.environ.setdefault(cpu_kernels.DIR_ENV, str(cpu_kernels.build_dir()))
