// nanobind's runtime, compiled into appliance.backend._mlx_fast (setup.py puts nanobind's src/ on
// the include path; setuptools wants the sources under the project).
#include "nb_combined.cpp"
