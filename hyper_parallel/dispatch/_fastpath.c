/* The replicated, no-grad cache-hit path of DTensor.__torch_function__, in C.

   Why: on a tiny model every op costs about a microsecond in torch itself, so the Python lines of the
   hottest path (scan the arguments, unwrap, call, wrap) cost as much as the op. This file does exactly what
   dispatcher._replicated_local does with grad=False, and nothing else: any call it does not cover is handed,
   before anything has run, to the Python torch_function, which is the one dispatch path. The Python version
   stays the reference (HYPER_PARALLEL_PURE_PYTHON=1 uses it; the tests compare the two).

   Only the CPython C API is used (no torch headers), so it builds in a second with any C compiler.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <structmember.h>

static PyTypeObject *dtensor_type;    /* hyper_parallel DTensor */
static PyTypeObject *tensor_type;     /* torch.Tensor */
static PyObject *fast_funcs;          /* dict func -> in-place?: funcs whose rule runs replicated inputs locally */
static PyObject *python_path;         /* dispatcher.torch_function_after_c(func, types, args, kwargs) */
static PyObject *grad_enabled;        /* torch.is_grad_enabled */
static PyObject *make_wrapper;        /* torch.Tensor._make_wrapper_subclass */
static PyObject *strided;             /* torch.strided */
static PyObject *wrap_other;          /* dispatcher._wrap_replicated(out, mesh, False) */
static PyObject *replicate_layout;    /* layout.replicate_layout(mesh, ndim) */
static PyObject *s_view_of, *s_shape, *s_replicated_layouts, *s_dtype, *s_device;

/* Returned (never dereferenced, never exposed) when the call must take the Python path. */
static char not_handled_mark;
#define NOT_HANDLED ((PyObject *)&not_handled_mark)

/* Attributes held in __slots__ (DTensor._local/_layout/_shape, Layout.is_replicate/mesh), read and written
   at the offsets their member descriptors give, for objects of exactly the configured type; objects of any
   other type (a subclass may add a property of the same name), or an unset slot, take the generic attribute
   protocol. Found once, in configure(). */
typedef struct {
    PyObject *name;      /* interned */
    PyTypeObject *type;  /* the exact type read this way; NULL before configure() */
    Py_ssize_t offset;   /* 0: not a plain object slot, use the generic protocol */
} Slot;

static Slot dt_local, dt_layout, dt_shape, layout_is_replicate, layout_mesh;

static int find_slot(Slot *slot, PyTypeObject *type) {
    slot->type = type;
    slot->offset = 0;
    PyObject *d = PyObject_GetAttr((PyObject *)type, slot->name);
    if (d == NULL) return -1;
    if (Py_IS_TYPE(d, &PyMemberDescr_Type)) {
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type == T_OBJECT_EX && !(m->flags & READONLY) && PyType_IsSubtype(type, PyDescr_TYPE(d)))
            slot->offset = m->offset;
    }
    Py_DECREF(d);
    return 0;
}

static PyObject *get_slot(PyObject *obj, const Slot *slot) {  /* new reference */
    if (slot->offset && Py_TYPE(obj) == slot->type) {
        PyObject *v = *(PyObject **)((char *)obj + slot->offset);
        if (v != NULL) {
            Py_INCREF(v);
            return v;
        }
    }
    return PyObject_GetAttr(obj, slot->name);
}

static int set_slot(PyObject *obj, const Slot *slot, PyObject *value) {
    if (slot->offset && Py_TYPE(obj) == slot->type) {
        PyObject **p = (PyObject **)((char *)obj + slot->offset);
        PyObject *old = *p;
        Py_INCREF(value);
        *p = value;
        Py_XDECREF(old);
        return 0;
    }
    return PyObject_SetAttr(obj, slot->name, value);
}

/* The local tensor of a replicated DTensor on *mesh (set on first use); NOT_HANDLED if split or on
   another mesh; NULL on error. New reference. */
static PyObject *unwrap(PyObject *dt, PyObject **mesh) {
    PyObject *layout = get_slot(dt, &dt_layout);
    if (layout == NULL) return NULL;
    PyObject *rep = get_slot(layout, &layout_is_replicate);
    if (rep == NULL) { Py_DECREF(layout); return NULL; }
    int is_rep = (rep == Py_True);
    Py_DECREF(rep);
    if (!is_rep) { Py_DECREF(layout); return NOT_HANDLED; }
    PyObject *m = get_slot(layout, &layout_mesh);
    Py_DECREF(layout);
    if (m == NULL) return NULL;
    if (*mesh == NULL) {
        *mesh = m;  /* the caller owns this reference */
    } else {
        int same = (m == *mesh);
        Py_DECREF(m);
        if (!same) return NOT_HANDLED;
    }
    return get_slot(dt, &dt_local);
}

/* One positional argument with DTensors replaced by their local tensors (lists/tuples one level deep). */
static PyObject *local_arg(PyObject *a, PyObject **mesh) {
    if (Py_TYPE(a) == dtensor_type) return unwrap(a, mesh);
    int is_list = PyList_CheckExact(a);
    if (is_list || PyTuple_CheckExact(a)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(a);
        PyObject **items = PySequence_Fast_ITEMS(a);
        PyObject *seq = is_list ? PyList_New(n) : PyTuple_New(n);
        if (seq == NULL) return NULL;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *b = items[i], *loc;
            if (Py_TYPE(b) == dtensor_type) {
                loc = unwrap(b, mesh);
                if (loc == NULL || loc == NOT_HANDLED) { Py_DECREF(seq); return loc; }
            } else if (PyList_CheckExact(b) || PyTuple_CheckExact(b)) {
                Py_DECREF(seq);
                return NOT_HANDLED;
            } else {
                Py_INCREF(b);
                loc = b;
            }
            if (is_list) PyList_SET_ITEM(seq, i, loc); else PyTuple_SET_ITEM(seq, i, loc);
        }
        return seq;
    }
    Py_INCREF(a);
    return a;
}

static PyObject *wrap(PyObject *out, PyObject *mesh) {
    PyObject *shape = PyObject_GetAttr(out, s_shape);
    if (shape == NULL) return NULL;
    PyObject *res = NULL, *layout = NULL, *dtype = NULL, *device = NULL;
    PyObject *ndim = PyLong_FromSsize_t(PyTuple_GET_SIZE(shape));
    PyObject *cache = PyObject_GetAttr(mesh, s_replicated_layouts);
    if (ndim == NULL || cache == NULL) goto done;
    layout = PyDict_GetItemWithError(cache, ndim);
    if (layout != NULL) {
        Py_INCREF(layout);
    } else if (PyErr_Occurred()) {
        goto done;
    } else {
        layout = PyObject_CallFunctionObjArgs(replicate_layout, mesh, ndim, NULL);
        if (layout == NULL) goto done;
    }
    dtype = PyObject_GetAttr(out, s_dtype);
    device = PyObject_GetAttr(out, s_device);
    if (dtype == NULL || device == NULL) goto done;
    {
        PyObject *argv[8] = {(PyObject *)dtensor_type, shape, Py_None, Py_None, Py_None, dtype, strided, device};
        res = PyObject_Vectorcall(make_wrapper, argv, 8, NULL);
    }
    if (res == NULL) goto done;
    if (set_slot(res, &dt_local, out) < 0 || set_slot(res, &dt_layout, layout) < 0 ||
        set_slot(res, &dt_shape, shape) < 0) {
        Py_CLEAR(res);
    }
done:
    Py_XDECREF(device);
    Py_XDECREF(dtype);
    Py_XDECREF(layout);
    Py_XDECREF(cache);
    Py_XDECREF(ndim);
    Py_DECREF(shape);
    return res;
}

/* An in-place write into a view that was taken of a redistributed copy must raise: the Python path does.
   -1 on error. */
static int write_is_lost(PyObject *target) {
    if (Py_TYPE(target) != dtensor_type) return 0;
    PyObject *view;
#if PY_VERSION_HEX >= 0x030D0000
    if (PyObject_GetOptionalAttr(target, s_view_of, &view) < 0) return -1;
#else
    if (_PyObject_LookupAttr(target, s_view_of, &view) < 0) return -1;
#endif
    int lost = (view == Py_False);
    Py_XDECREF(view);
    return lost;
}

/* dispatcher._replicated_local(func, args, kwargs, grad=False, inplace): a new reference, NOT_HANDLED, or NULL. */
static PyObject *replicated_local(PyObject *func, PyObject *args, PyObject *kwargs) {
    PyObject *inplace = PyDict_GetItemWithError(fast_funcs, func);  /* borrowed: Py_True for in-place ops */
    if (inplace == NULL) { PyErr_Clear(); return NOT_HANDLED; }  /* unhashable funcs are simply not fast */
    PyObject *g = PyObject_CallNoArgs(grad_enabled);
    if (g == NULL) return NULL;
    int grad = (g == Py_True);
    Py_DECREF(g);
    if (grad || !PyTuple_Check(args)) return NOT_HANDLED;
    if (kwargs == Py_None) kwargs = NULL;
    if (kwargs != NULL && !PyDict_Check(kwargs)) return NOT_HANDLED;
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    PyObject *mesh = NULL, *local_kwargs = NULL, *out = NULL, *res = NOT_HANDLED;
    PyObject *locs = PyTuple_New(n);
    if (locs == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *loc = local_arg(PyTuple_GET_ITEM(args, i), &mesh);
        if (loc == NULL || loc == NOT_HANDLED) { res = loc; goto done; }
        PyTuple_SET_ITEM(locs, i, loc);
    }
    if (kwargs != NULL) {
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(kwargs, &pos, &k, &v)) {
            if (Py_TYPE(v) == dtensor_type) {
                PyObject *loc = unwrap(v, &mesh);
                if (loc == NULL || loc == NOT_HANDLED) { res = loc; goto done; }
                if (local_kwargs == NULL && (local_kwargs = PyDict_Copy(kwargs)) == NULL) {
                    Py_DECREF(loc);
                    res = NULL;
                    goto done;
                }
                int failed = PyDict_SetItem(local_kwargs, k, loc) < 0;
                Py_DECREF(loc);
                if (failed) { res = NULL; goto done; }
            } else if (PyList_CheckExact(v) || PyTuple_CheckExact(v)) {
                goto done;
            }
        }
    }
    if (mesh == NULL || n == 0) goto done;
    if (inplace == Py_True) {
        int lost = write_is_lost(PyTuple_GET_ITEM(args, 0));
        if (lost < 0) { res = NULL; goto done; }
        if (lost) goto done;
    }
    out = PyObject_Call(func, locs, local_kwargs != NULL ? local_kwargs : kwargs);
    if (out == NULL) {
        res = NULL;
    } else if (Py_TYPE(out) != tensor_type) {
        res = PyObject_CallFunctionObjArgs(wrap_other, out, mesh, Py_False, NULL);
    } else if (Py_TYPE(PyTuple_GET_ITEM(args, 0)) == dtensor_type && out == PyTuple_GET_ITEM(locs, 0)) {
        res = PyTuple_GET_ITEM(args, 0);  /* in-place ops, `x.to(x.dtype)`: the same tensor, as torch returns it */
        Py_INCREF(res);
    } else {
        res = wrap(out, mesh);
    }
done:
    Py_XDECREF(out);
    Py_XDECREF(local_kwargs);
    Py_DECREF(locs);
    Py_XDECREF(mesh);
    return res;
}

/* __torch_function__(func, types, args=(), kwargs=None), installed as a staticmethod. */
static PyObject *torch_function(PyObject *module, PyObject *const *argv, Py_ssize_t nargs, PyObject *kwnames) {
    if (python_path == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "hyper_parallel._fastpath used before configure()");
        return NULL;
    }
    if (kwnames == NULL && nargs >= 3) {
        PyObject *res = replicated_local(argv[0], argv[2], nargs >= 4 ? argv[3] : NULL);
        if (res != NOT_HANDLED) return res;
    }
    return PyObject_Vectorcall(python_path, argv, nargs, kwnames);
}

/* The tp_getattr slot of the DTensor type and of torch's tensor metaclass. torch (on Python < 3.13) asks, by
   C string, every tensor argument of every call and the class of every wrapper it makes for
   "__torch_function__" and "__torch_dispatch__", and the torch.Tensor class for the method being called.
   It goes through tp_getattr when the type has one; otherwise it builds a new, uninterned Python string each
   time, which misses CPython's attribute cache and searches the MRO (for a class, its metaclass's MRO too)
   dict by dict. Answering with interned strings turns those searches into cache hits; Python code itself
   never uses this slot. */
#define N_NAMES 8
static const char *name_texts[N_NAMES];
static PyObject *name_objs[N_NAMES];

static PyObject *getattr_by_c_string(PyObject *obj, char *name) {
    int i = 0;
    for (; i < N_NAMES && name_texts[i] != NULL; i++)
        if (strcmp(name, name_texts[i]) == 0) return PyObject_GetAttr(obj, name_objs[i]);
    PyObject *s = PyUnicode_InternFromString(name);
    if (s == NULL) return NULL;
    if (i < N_NAMES) {  /* remember it: torch asks with a handful of constant names */
        name_objs[i] = s;
        name_texts[i] = PyUnicode_AsUTF8(s);
        if (name_texts[i] == NULL) { name_objs[i] = NULL; Py_DECREF(s); return NULL; }
        Py_INCREF(s);
    }
    PyObject *res = PyObject_GetAttr(obj, s);
    Py_DECREF(s);
    return res;
}

static PyObject *configure(PyObject *module, PyObject *args) {
    PyObject *dt, *tt, *lt, *ff, *pp, *ge, *mw, *st, *wo, *rl;
    if (!PyArg_ParseTuple(args, "O!O!O!O!OOOOOO:configure", &PyType_Type, &dt, &PyType_Type, &tt, &PyType_Type, &lt,
                          &PyDict_Type, &ff, &pp, &ge, &mw, &st, &wo, &rl))
        return NULL;
    PyObject **slots[] = {(PyObject **)&dtensor_type, (PyObject **)&tensor_type, &fast_funcs, &python_path,
                          &grad_enabled, &make_wrapper, &strided, &wrap_other, &replicate_layout};
    PyObject *vals[] = {dt, tt, ff, pp, ge, mw, st, wo, rl};
    for (int i = 0; i < 9; i++) {
        Py_INCREF(vals[i]);
        Py_XSETREF(*slots[i], vals[i]);
    }
    struct { Slot *slot; PyTypeObject *type; } found[] = {
        {&dt_local, dtensor_type}, {&dt_layout, dtensor_type}, {&dt_shape, dtensor_type},
        {&layout_is_replicate, (PyTypeObject *)lt}, {&layout_mesh, (PyTypeObject *)lt}};
    for (int i = 0; i < 5; i++)
        if (find_slot(found[i].slot, found[i].type) < 0) return NULL;
    if (dtensor_type->tp_getattr == NULL) dtensor_type->tp_getattr = getattr_by_c_string;
    /* torch._C._TensorMeta: the same answers as its tp_getattro gives, found through the attribute cache. */
    PyTypeObject *meta = Py_TYPE(tensor_type);
    if (meta != &PyType_Type && meta->tp_getattr == NULL && meta->tp_getattro == PyType_Type.tp_getattro)
        meta->tp_getattr = getattr_by_c_string;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"torch_function", (PyCFunction)(void (*)(void))torch_function, METH_FASTCALL | METH_KEYWORDS,
     "DTensor.__torch_function__: the replicated no-grad path in C, everything else in Python."},
    {"configure", configure, METH_VARARGS, "Hand the module the Python objects it works with."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_fastpath", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fastpath(void) {
    PyObject **names[] = {&dt_local.name, &dt_layout.name, &s_shape, &dt_shape.name, &layout_is_replicate.name,
                          &layout_mesh.name, &s_replicated_layouts, &s_dtype, &s_device, &s_view_of};
    const char *texts[] = {"_local", "_layout", "shape", "_shape", "is_replicate", "mesh", "replicated_layouts",
                           "dtype", "device", "_view_of"};
    for (int i = 0; i < 10; i++) {
        *names[i] = PyUnicode_InternFromString(texts[i]);
        if (*names[i] == NULL) return NULL;
    }
    return PyModule_Create(&moduledef);
}
