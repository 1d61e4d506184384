// nanobind's runtime, compiled into appliance.backend._mlx_fast (CMakeLists.txt puts nanobind's src/ on
// the include path; the sources stay under the project).
#include "nb_combined.cpp"
