// The Python extension module base_moe._C: importing it loads the shared library, whose static
// initialisers register the ops with torch. It defines nothing else (ops are reached via torch.ops).
#include <Python.h>

extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
