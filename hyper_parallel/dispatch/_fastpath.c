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
/* The grad-mode twin (configure_grad): */
static PyObject *passthrough;         /* dispatcher._PASSTHROUGH: the wrapper's own metadata, run on the wrapper */
static PyObject *disabled_impl;       /* torch._C._disabled_torch_function_impl(func, types, args, kwargs) */
static PyObject *local_input_fn;      /* autograd.local_input(t, layout, layout): an input that requires grad */
static PyObject *wrap_local_fn;       /* autograd.wrap_local(out, layout, shape): a result that requires grad */
static PyObject *note_view_fn;        /* dispatcher._note_view(res, args, loc0, out, func, largs, lkwargs) */
static PyObject *grad_declined;       /* dispatcher.torch_function_after_c_grad: where declined grad calls go */
static PyObject *grad_entry;          /* this module's _under_disabled_torch_function, run inside disabled_impl */
static PyObject *not_handled_obj;     /* dispatcher._NOT_HANDLED, what _replicated_local_grad returns to decline */
static PyObject *empty_dict;          /* dispatcher._NO_KWARGS */
static PyObject *s_requires_grad, *s_base, *s_hp_copy;
/* The decision path's cache hit (configure_decision): */
static PyObject *rule_of;             /* dispatcher._RULE_OF: func -> (name, rule, inplace) */
static PyObject *decisions;           /* dispatcher._CACHE: call key -> Decision */
static PyObject *recorders;           /* registry._RECORDERS: while any records, every call takes the Python path */
static PyObject *wrap_outs_fn;        /* dispatcher._wrap_outs(out, layouts, shapes, grad) */
static PyObject *s_float_args_matter, *s_in_layouts, *s_grad_layouts, *s_out_layouts, *s_out_shapes, *s_local_fn;
static PyTypeObject *local_reshape_type; /* dispatch.call.LocalReshape: a local_fn that is `t.reshape(shape)` */
static PyObject *tensor_reshape;      /* torch.Tensor.reshape */

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

static Slot dt_local, dt_layout, dt_shape, layout_is_replicate, layout_mesh, reshape_shape;

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

/* The replicated layout of `ndim` dims on `mesh`: mesh.replicated_layouts.get(ndim) or replicate_layout(...). */
static PyObject *replicated_layout(PyObject *mesh, Py_ssize_t n) {  /* new reference */
    PyObject *layout = NULL, *ndim = PyLong_FromSsize_t(n);
    PyObject *cache = PyObject_GetAttr(mesh, s_replicated_layouts);
    if (ndim == NULL || cache == NULL) goto done;
    layout = PyDict_GetItemWithError(cache, ndim);
    if (layout != NULL) {
        Py_INCREF(layout);
    } else if (!PyErr_Occurred()) {
        layout = PyObject_CallFunctionObjArgs(replicate_layout, mesh, ndim, NULL);
    }
done:
    Py_XDECREF(cache);
    Py_XDECREF(ndim);
    return layout;
}

/* The keyword arguments with DTensors replaced by their locals in *local_kwargs (this call's own copy, made on
   first use; left NULL when there are none): 0; 1 when the call is not covered (a split input, another mesh, a
   list or tuple value, more inputs that require grad than `needs` holds); -1 on error. With `needs` (grad mode),
   the DTensors whose wrapper requires grad are noted there. */
typedef struct Need Need;
static int note_need(Need *needs, int *n, Py_ssize_t i, Py_ssize_t j, PyObject *key);
static int wrapper_requires_grad(PyObject *dt);

static int local_kwargs_of(PyObject *kwargs, PyObject **mesh, PyObject **local_kwargs, Need *needs, int *n_needs) {
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(kwargs, &pos, &k, &v)) {
        if (Py_TYPE(v) == dtensor_type) {
            PyObject *loc = unwrap(v, mesh);
            if (loc == NULL) return -1;
            if (loc == NOT_HANDLED) return 1;
            if (*local_kwargs == NULL && (*local_kwargs = PyDict_Copy(kwargs)) == NULL) {
                Py_DECREF(loc);
                return -1;
            }
            int failed = PyDict_SetItem(*local_kwargs, k, loc) < 0;
            Py_DECREF(loc);
            if (failed) return -1;
            if (needs != NULL) {
                int rg = wrapper_requires_grad(v);
                if (rg < 0) return -1;
                if (rg && !note_need(needs, n_needs, -1, -1, k)) return 1;
            }
        } else if (PyList_CheckExact(v) || PyTuple_CheckExact(v)) {
            return 1;
        }
    }
    return 0;
}

static PyObject *wrap(PyObject *out, PyObject *mesh) {
    PyObject *shape = PyObject_GetAttr(out, s_shape);
    if (shape == NULL) return NULL;
    PyObject *res = NULL, *dtype = NULL, *device = NULL;
    PyObject *layout = replicated_layout(mesh, PyTuple_GET_SIZE(shape));
    if (layout == NULL) goto done;
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
    Py_DECREF(shape);
    return res;
}

/* dispatcher._wrap_replicated(out, mesh, False) for a list or tuple of plain tensors (what the optimizers'
   out-of-place _foreach_* ops return), each wrapped as `wrap` does; NOT_HANDLED (before making anything) for any
   other sequence. */
static PyObject *wrap_seq(PyObject *out, PyObject *mesh) {
    int is_list = PyList_CheckExact(out);
    if (!is_list && !PyTuple_CheckExact(out)) return NOT_HANDLED;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(out);
    PyObject **items = PySequence_Fast_ITEMS(out);
    for (Py_ssize_t i = 0; i < n; i++)
        if (Py_TYPE(items[i]) != tensor_type) return NOT_HANDLED;
    PyObject *res = is_list ? PyList_New(n) : PyTuple_New(n);
    if (res == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *w = wrap(items[i], mesh);
        if (w == NULL) { Py_DECREF(res); return NULL; }
        if (is_list) PyList_SET_ITEM(res, i, w); else PyTuple_SET_ITEM(res, i, w);
    }
    return res;
}

static int lookup_attr(PyObject *obj, PyObject *name, PyObject **value) {  /* *value NULL when absent */
#if PY_VERSION_HEX >= 0x030D0000
    return PyObject_GetOptionalAttr(obj, name, value);
#else
    return _PyObject_LookupAttr(obj, name, value);
#endif
}

/* An in-place write into a view that was taken of a redistributed copy (`_view_of` False), or into a view of such
   a view (dispatcher._views_a_copy: its local's root is marked `_hp_copy`), takes the Python path, which writes it
   back or raises. -1 on error. */
static int write_is_lost(PyObject *target) {
    if (Py_TYPE(target) != dtensor_type) return 0;
    PyObject *view;
    if (lookup_attr(target, s_view_of, &view) < 0) return -1;
    int lost = (view == Py_False);
    Py_XDECREF(view);
    if (lost) return 1;
    PyObject *loc = get_slot(target, &dt_local);
    if (loc == NULL) return -1;
    PyObject *base = PyObject_GetAttr(loc, s_base);
    Py_DECREF(loc);
    if (base == NULL) return -1;
    PyObject *mark = NULL;
    int r = base == Py_None ? 0 : lookup_attr(base, s_hp_copy, &mark);
    Py_DECREF(base);
    if (r < 0) return -1;
    lost = (mark == Py_True);
    Py_XDECREF(mark);
    return lost;
}

/* dispatcher._returns_first_list: `out` is a list holding exactly the locals `loc0` of the first argument `a0` (a list
   or tuple), as an in-place list-wise op (torch._foreach_mul_) returns them. */
static int returns_first_list(PyObject *out, PyObject *a0, PyObject *loc0) {
    if (!PyList_CheckExact(out) || !(PyList_CheckExact(a0) || PyTuple_CheckExact(a0))) return 0;
    Py_ssize_t n = PyList_GET_SIZE(out);
    if (PySequence_Fast_GET_SIZE(a0) != n || PySequence_Fast_GET_SIZE(loc0) != n) return 0;
    PyObject **items = PySequence_Fast_ITEMS(loc0);
    for (Py_ssize_t i = 0; i < n; i++)
        if (PyList_GET_ITEM(out, i) != items[i]) return 0;
    return 1;
}

/* dispatcher._replicated_local(func, args, kwargs, grad=False, inplace) (`inplace` borrowed from fast_funcs):
   a new reference, NOT_HANDLED, or NULL. */
static PyObject *replicated_local(PyObject *func, PyObject *args, PyObject *kwargs, PyObject *inplace) {
    if (!PyTuple_Check(args)) return NOT_HANDLED;
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
        int r = local_kwargs_of(kwargs, &mesh, &local_kwargs, NULL, NULL);
        if (r < 0) { res = NULL; goto done; }
        if (r) goto done;
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
    } else if (returns_first_list(out, PyTuple_GET_ITEM(args, 0), PyTuple_GET_ITEM(locs, 0))) {
        res = PySequence_List(PyTuple_GET_ITEM(args, 0));  /* in-place list-wise ops: the first list's DTensors */
    } else if (Py_TYPE(out) != tensor_type) {
        res = wrap_seq(out, mesh);
        if (res == NOT_HANDLED) res = PyObject_CallFunctionObjArgs(wrap_other, out, mesh, Py_False, NULL);
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


/* ---- grad mode: dispatcher._replicated_local(func, args, kwargs, grad=True, inplace=False) ----------------
   Runs inside torch._C._disabled_torch_function_impl (as the Python twin runs inside
   DisableTorchFunctionSubclass), so reading a wrapper's `requires_grad` is torch's plain getter. Inputs whose
   wrapper requires grad are noted while scanning and only go through autograd.local_input once the call is
   known to be covered, so a declined call has run nothing. */
#define MAX_NEEDS 16

struct Need {
    Py_ssize_t i, j;  /* positional argument, index in its list/tuple (-1: the argument itself) */
    PyObject *key;    /* or a keyword argument (borrowed), i = -1 */
};

/* Is obj.<name> the object `value` (Py_True, Py_False, ...)? 1, 0, or -1 on error. */
static int attr_is(PyObject *obj, PyObject *name, PyObject *value) {
    PyObject *got = PyObject_GetAttr(obj, name);
    if (got == NULL) return -1;
    int yes = (got == value);
    Py_DECREF(got);
    return yes;
}

/* The DTensor `dt` requires grad at its wrapper: 1, 0, or -1 on error. */
static int wrapper_requires_grad(PyObject *dt) {
    return attr_is(dt, s_requires_grad, Py_True);
}

/* autograd.local_input(dt, layout, layout) for an input of the replicated path, given its local `loc`
   (borrowed): the local itself when it carries history (the identity case), else an Unwrap node. New ref. */
static PyObject *grad_local(PyObject *dt, PyObject *loc) {
    PyObject *rg = PyObject_GetAttr(loc, s_requires_grad);
    if (rg == NULL) return NULL;
    int identity = (rg == Py_True);
    Py_DECREF(rg);
    if (identity) {
        Py_INCREF(loc);
        return loc;
    }
    PyObject *layout = get_slot(dt, &dt_layout);
    if (layout == NULL) return NULL;
    PyObject *res = PyObject_CallFunctionObjArgs(local_input_fn, dt, layout, layout, NULL);
    Py_DECREF(layout);
    return res;
}

static int note_need(Need *needs, int *n, Py_ssize_t i, Py_ssize_t j, PyObject *key) {
    if (*n == MAX_NEEDS) return 0;  /* more inputs that require grad than noted here: the Python twin */
    needs[*n].i = i;
    needs[*n].j = j;
    needs[*n].key = key;
    (*n)++;
    return 1;
}

static PyObject *replicated_local_grad(PyObject *func, PyObject *args, PyObject *kwargs) {
    if (!PyTuple_Check(args)) return NOT_HANDLED;
    if (kwargs == Py_None) kwargs = NULL;
    if (kwargs != NULL && !PyDict_Check(kwargs)) return NOT_HANDLED;
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    if (n == 0) return NOT_HANDLED;
    Need needs[MAX_NEEDS];
    int n_needs = 0;
    PyObject *mesh = NULL, *local_kwargs = NULL, *out = NULL, *res = NOT_HANDLED, *layout = NULL, *shape = NULL;
    PyObject *locs = PyTuple_New(n);
    if (locs == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = PyTuple_GET_ITEM(args, i);
        PyObject *loc = local_arg(a, &mesh);
        if (loc == NULL || loc == NOT_HANDLED) { res = loc; goto done; }
        PyTuple_SET_ITEM(locs, i, loc);
        if (Py_TYPE(a) == dtensor_type) {
            int rg = wrapper_requires_grad(a);
            if (rg < 0) { res = NULL; goto done; }
            if (rg && !note_need(needs, &n_needs, i, -1, NULL)) goto done;
        } else if (PyList_CheckExact(a) || PyTuple_CheckExact(a)) {
            Py_ssize_t m = PySequence_Fast_GET_SIZE(a);
            for (Py_ssize_t j = 0; j < m; j++) {
                PyObject *b = PySequence_Fast_GET_ITEM(a, j);
                if (Py_TYPE(b) != dtensor_type) continue;
                int rg = wrapper_requires_grad(b);
                if (rg < 0) { res = NULL; goto done; }
                if (rg && !note_need(needs, &n_needs, i, j, NULL)) goto done;
            }
        }
    }
    if (kwargs != NULL) {
        int r = local_kwargs_of(kwargs, &mesh, &local_kwargs, needs, &n_needs);
        if (r < 0) { res = NULL; goto done; }
        if (r) goto done;
    }
    if (mesh == NULL) goto done;
    /* Covered: from here on the call runs. Inputs that require grad enter through local_input. */
    for (int k = 0; k < n_needs; k++) {
        Need *nd = &needs[k];
        if (nd->key != NULL) {
            PyObject *dt = PyDict_GetItemWithError(kwargs, nd->key);  /* borrowed */
            PyObject *loc = dt == NULL ? NULL : PyDict_GetItemWithError(local_kwargs, nd->key);
            if (loc == NULL) { if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "kwarg"); res = NULL; goto done; }
            PyObject *g = grad_local(dt, loc);
            if (g == NULL) { res = NULL; goto done; }
            int failed = PyDict_SetItem(local_kwargs, nd->key, g) < 0;
            Py_DECREF(g);
            if (failed) { res = NULL; goto done; }
        } else if (nd->j < 0) {
            PyObject *g = grad_local(PyTuple_GET_ITEM(args, nd->i), PyTuple_GET_ITEM(locs, nd->i));
            if (g == NULL) { res = NULL; goto done; }
            PyObject *old = PyTuple_GET_ITEM(locs, nd->i);
            PyTuple_SET_ITEM(locs, nd->i, g);
            Py_DECREF(old);
        } else {  /* the list/tuple in locs is this call's own */
            PyObject *seq = PyTuple_GET_ITEM(locs, nd->i);
            PyObject *g = grad_local(PySequence_Fast_GET_ITEM(PyTuple_GET_ITEM(args, nd->i), nd->j),
                                     PySequence_Fast_GET_ITEM(seq, nd->j));
            if (g == NULL) { res = NULL; goto done; }
            PyObject **items = PySequence_Fast_ITEMS(seq);
            PyObject *old = items[nd->j];
            items[nd->j] = g;
            Py_DECREF(old);
        }
    }
    PyObject *call_kwargs = local_kwargs != NULL ? local_kwargs : kwargs;
    out = PyObject_Call(func, locs, call_kwargs);
    if (out == NULL) { res = NULL; goto done; }
    PyObject *a0 = PyTuple_GET_ITEM(args, 0);
    if (Py_TYPE(out) != tensor_type) {
        res = PyObject_CallFunctionObjArgs(wrap_other, out, mesh, Py_True, NULL);
        goto done;
    }
    if (Py_TYPE(a0) == dtensor_type && out == PyTuple_GET_ITEM(locs, 0)) {
        res = a0;  /* `x.to(x.dtype)`, `x.contiguous()`: the same tensor, as torch returns it */
        Py_INCREF(res);
        goto done;
    }
    int rg = wrapper_requires_grad(out);
    if (rg < 0) { res = NULL; goto done; }
    if (rg) {
        shape = PyObject_GetAttr(out, s_shape);
        if (shape == NULL) { res = NULL; goto done; }
        layout = replicated_layout(mesh, PyTuple_GET_SIZE(shape));
        if (layout == NULL) { res = NULL; goto done; }
        res = PyObject_CallFunctionObjArgs(wrap_local_fn, out, layout, shape, NULL);
    } else {
        res = wrap(out, mesh);
    }
    if (res == NULL || Py_TYPE(a0) != dtensor_type) goto done;
    PyObject *base = PyObject_GetAttr(out, s_base);
    if (base == NULL) { Py_CLEAR(res); goto done; }
    int is_view = (base != Py_None);
    Py_DECREF(base);
    if (is_view) {  /* dispatcher._note_view: remember what the view was taken of, for in-place writes */
        PyObject *noted = PyObject_CallFunctionObjArgs(note_view_fn, res, args, PyTuple_GET_ITEM(locs, 0), out, func,
                                                       locs, call_kwargs != NULL ? call_kwargs : empty_dict, NULL);
        if (noted == NULL) Py_CLEAR(res); else Py_DECREF(noted);
    }
done:
    Py_XDECREF(shape);
    Py_XDECREF(layout);
    Py_XDECREF(out);
    Py_XDECREF(local_kwargs);
    Py_DECREF(locs);
    Py_XDECREF(mesh);
    return res;
}


/* ---- the decision path's cache hit: dispatcher._dispatch for a flat call (tensors only among positional
   arguments, no keyword arguments) whose key is in the decision cache ----------------------------------------
   Same key as _dispatch builds, same Decision replayed when it moves no input (every input already in its target
   layout, used as it is; in grad mode an input that requires grad through local_input). A plain tensor among the
   arguments, a list, a slice, recording, a replicated call, a cache miss or a decision that redistributes an
   input return NOT_HANDLED before anything has run. Runs inside _disabled_torch_function_impl, as _dispatch runs inside
   DisableTorchFunctionSubclass. */
static PyObject *new_dtensor(PyObject *local, PyObject *layout, PyObject *shape);  /* defined with the nodes */

/* dispatcher._note_view(res, args, loc0, out, func, largs, {}) for a flat call, without a Python frame: `res` (the
   wrapped result) views args[0]; `base` is out._base (not None); loc0 the local it was taken of, or NULL when the
   view was taken of a moved copy (then a write into it would be lost: _view_of = False). 0, or -1 on error. */
static int note_view_here(PyObject *res, PyObject *args, PyObject *loc0, PyObject *base, PyObject *func,
                          PyObject *largs) {
    PyObject *a0 = PyTuple_GET_ITEM(args, 0);
    if (Py_TYPE(a0) != dtensor_type || Py_TYPE(res) != dtensor_type || res == a0) return 0;
    int of_loc0 = 0;
    if (loc0 != NULL) {
        of_loc0 = (base == loc0);
        if (!of_loc0) {
            PyObject *lbase = PyObject_GetAttr(loc0, s_base);
            if (lbase == NULL) return -1;
            of_loc0 = (lbase != Py_None && lbase == base);
            Py_DECREF(lbase);
        }
    }
    if (!of_loc0) return PyObject_SetAttr(res, s_view_of, Py_False);
    PyObject *rest = PyTuple_GetSlice(largs, 1, PyTuple_GET_SIZE(largs));
    if (rest == NULL) return -1;
    PyObject *view = PyTuple_Pack(4, a0, func, rest, empty_dict);
    Py_DECREF(rest);
    if (view == NULL) return -1;
    int r = PyObject_SetAttr(res, s_view_of, view);
    Py_DECREF(view);
    return r;
}

static PyObject *decision_hit(PyObject *func, PyObject *args, PyObject *kwargs, int grad_mode) {
    if (rule_of == NULL || !PyTuple_Check(args)) return NOT_HANDLED;
    if (kwargs != NULL && kwargs != Py_None && (!PyDict_Check(kwargs) || PyDict_GET_SIZE(kwargs) != 0))
        return NOT_HANDLED;
    if (PyList_GET_SIZE(recorders) != 0) return NOT_HANDLED;
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    if (n == 0) return NOT_HANDLED;
    PyObject *entry = PyDict_GetItemWithError(rule_of, func);  /* borrowed */
    if (entry == NULL) { PyErr_Clear(); return NOT_HANDLED; }
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 3 || PyTuple_GET_ITEM(entry, 1) == Py_None)
        return NOT_HANDLED;
    PyObject *rule = PyTuple_GET_ITEM(entry, 1);
    PyObject *mesh = NULL, *parts = NULL, *key = NULL, *largs = NULL, *out = NULL, *res = NOT_HANDLED;
    PyObject *in_layouts = NULL, *grad_layouts = NULL, *out_layouts = NULL, *out_shapes = NULL, *local_fn = NULL;
    int floats = -1, replicated = 1, grad = 0;
    parts = PyTuple_New(n);
    if (parts == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = PyTuple_GET_ITEM(args, i), *part;
        if (Py_TYPE(a) == dtensor_type) {
            PyObject *layout = get_slot(a, &dt_layout);
            if (layout == NULL) { res = NULL; goto done; }
            PyObject *m = get_slot(layout, &layout_mesh), *rep = get_slot(layout, &layout_is_replicate);
            if (m == NULL || rep == NULL) { Py_XDECREF(m); Py_XDECREF(rep); Py_DECREF(layout); res = NULL; goto done; }
            if (rep != Py_True) replicated = 0;
            Py_DECREF(rep);
            if (mesh == NULL) {
                mesh = m;
            } else {
                int same = (m == mesh);
                Py_DECREF(m);
                if (!same) { Py_DECREF(layout); goto done; }  /* different meshes: _dispatch raises */
            }
            PyObject *shape = get_slot(a, &dt_shape), *loc = get_slot(a, &dt_local), *dtype = NULL;
            if (loc != NULL) dtype = PyObject_GetAttr(loc, s_dtype);
            part = (shape != NULL && dtype != NULL) ? PyTuple_Pack(3, layout, shape, dtype) : NULL;
            Py_DECREF(layout);
            Py_XDECREF(shape);
            Py_XDECREF(loc);
            Py_XDECREF(dtype);
            if (part == NULL) { res = NULL; goto done; }
            if (grad_mode && !grad) {
                int rg = wrapper_requires_grad(a);
                if (rg < 0) { Py_DECREF(part); res = NULL; goto done; }
                grad = rg;
            }
        } else if (PyObject_TypeCheck(a, tensor_type) || PyList_CheckExact(a) || PyTuple_CheckExact(a) ||
                   PySlice_Check(a)) {
            goto done;  /* a plain tensor, a nested structure, a slice: _dispatch's other branches */
        } else if (PyFloat_CheckExact(a)) {
            if (floats < 0) {
                PyObject *fl = PyObject_GetAttr(rule, s_float_args_matter);
                if (fl == NULL) { res = NULL; goto done; }
                floats = PyObject_IsTrue(fl);
                Py_DECREF(fl);
                if (floats < 0) { res = NULL; goto done; }
            }
            part = floats ? a : (PyObject *)&PyFloat_Type;
            Py_INCREF(part);
        } else {
            part = a;
            Py_INCREF(part);
        }
        PyTuple_SET_ITEM(parts, i, part);
    }
    if (mesh == NULL || replicated) goto done;  /* no DTensor, or every input replicated: the replicated path */
    key = PyTuple_Pack(3, func, parts, Py_None);
    if (key == NULL) { res = NULL; goto done; }
    PyObject *dec = PyDict_GetItemWithError(decisions, key);  /* borrowed, kept alive by the cache */
    if (dec == NULL) {
        if (PyErr_Occurred()) PyErr_Clear();  /* an unhashable argument: _dispatch decides every time */
        goto done;
    }
    Py_INCREF(dec);
    in_layouts = PyObject_GetAttr(dec, s_in_layouts);
    grad_layouts = PyObject_GetAttr(dec, s_grad_layouts);
    out_layouts = PyObject_GetAttr(dec, s_out_layouts);
    out_shapes = PyObject_GetAttr(dec, s_out_shapes);
    local_fn = PyObject_GetAttr(dec, s_local_fn);
    Py_DECREF(dec);
    if (in_layouts == NULL || grad_layouts == NULL || out_layouts == NULL || out_shapes == NULL || local_fn == NULL) {
        res = NULL;
        goto done;
    }
    if (!PyList_Check(in_layouts) && !PyTuple_Check(in_layouts)) goto done;
    if (!PyList_Check(grad_layouts) && !PyTuple_Check(grad_layouts)) goto done;
    {   /* Only hits that move no input: a redistribution may communicate, and collectives are issued from
           _dispatch, whose frame check mode and CollectiveError read to name the op. */
        Py_ssize_t k = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *a = PyTuple_GET_ITEM(args, i);
            if (Py_TYPE(a) != dtensor_type) continue;
            if (k >= PySequence_Fast_GET_SIZE(in_layouts) || k >= PySequence_Fast_GET_SIZE(grad_layouts)) goto done;
            PyObject *layout = get_slot(a, &dt_layout);
            if (layout == NULL) { res = NULL; goto done; }
            int moves = PySequence_Fast_GET_ITEM(in_layouts, k) != layout;
            Py_DECREF(layout);
            if (moves) goto done;
            k++;
        }
    }
    /* Covered: from here on the call runs. */
    largs = PyTuple_New(n);
    if (largs == NULL) { res = NULL; goto done; }
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = PyTuple_GET_ITEM(args, i), *loc;
        if (Py_TYPE(a) != dtensor_type) {
            Py_INCREF(a);
            PyTuple_SET_ITEM(largs, i, a);
            continue;
        }
        PyObject *target = PySequence_Fast_GET_ITEM(in_layouts, k), *glay = PySequence_Fast_GET_ITEM(grad_layouts, k);
        k++;
        int rg = 0;
        if (grad) {
            rg = wrapper_requires_grad(a);
            if (rg < 0) { res = NULL; goto done; }
        }
        if (rg)
            loc = PyObject_CallFunctionObjArgs(local_input_fn, a, target, glay, NULL);
        else  /* target is the input's own layout (checked above) */
            loc = get_slot(a, &dt_local);
        if (loc == NULL) { res = NULL; goto done; }
        PyTuple_SET_ITEM(largs, i, loc);
    }
    if (Py_TYPE(local_fn) == local_reshape_type) {  /* LocalReshape.__call__: t.reshape(shape), no Python frame */
        PyObject *shape = get_slot(local_fn, &reshape_shape);
        if (shape == NULL) { res = NULL; goto done; }
        PyObject *argv[2] = {PyTuple_GET_ITEM(largs, 0), shape};
        out = PyObject_Vectorcall(tensor_reshape, argv, 2, NULL);
        Py_DECREF(shape);
    } else {
        out = PyObject_Call(local_fn != Py_None ? local_fn : func, largs, NULL);
    }
    if (out == NULL) { res = NULL; goto done; }
    PyObject *gflag = grad ? Py_True : Py_False;
    if (out_layouts == Py_None) {
        res = PyObject_CallFunctionObjArgs(wrap_other, out, mesh, gflag, NULL);
        goto done;
    }
    int single = Py_TYPE(out) == tensor_type;
    if (single && out_shapes != Py_None && PyList_Check(out_layouts) && PyList_GET_SIZE(out_layouts) > 0 &&
        PyList_Check(out_shapes) && PyList_GET_SIZE(out_shapes) > 0) {
        PyObject *layout = PyList_GET_ITEM(out_layouts, 0), *shape = PyList_GET_ITEM(out_shapes, 0);
        int rg = 0;
        if (grad) {
            rg = wrapper_requires_grad(out);
            if (rg < 0) { res = NULL; goto done; }
        }
        if (rg) {
            res = PyObject_CallFunctionObjArgs(wrap_local_fn, out, layout, shape, NULL);
        } else {
            res = new_dtensor(out, layout, shape);  /* the Decision's shapes are torch.Size already */
        }
    } else {
        res = PyObject_CallFunctionObjArgs(wrap_outs_fn, out, out_layouts, out_shapes, gflag, NULL);
    }
    if (res == NULL || !single || Py_TYPE(PyTuple_GET_ITEM(args, 0)) != dtensor_type) goto done;
    PyObject *base = PyObject_GetAttr(out, s_base);
    if (base == NULL) { Py_CLEAR(res); goto done; }
    if (base != Py_None) {  /* dispatcher._note_view; loc0 None when the view was taken of a moved copy */
        PyObject *a0 = PyTuple_GET_ITEM(args, 0);
        PyObject *layout0 = get_slot(a0, &dt_layout);
        /* as _dispatch: a LocalReshape views the unmoved input's own local, its history replays the LocalReshape */
        int reshaped = Py_TYPE(local_fn) == local_reshape_type;
        int moved = layout0 != NULL && (PySequence_Fast_GET_ITEM(in_layouts, 0) != layout0 ||
                                        (local_fn != Py_None && !reshaped));
        Py_XDECREF(layout0);
        /* as _dispatch: a no-grad view of the unmoved input needs no note */
        if (layout0 == NULL ||
            ((moved || grad_mode) &&
             note_view_here(res, args, moved ? NULL : PyTuple_GET_ITEM(largs, 0), base,
                            reshaped ? local_fn : func, largs) < 0))
            Py_CLEAR(res);
    }
    Py_DECREF(base);
done:
    Py_XDECREF(out);
    Py_XDECREF(largs);
    Py_XDECREF(local_fn);
    Py_XDECREF(out_shapes);
    Py_XDECREF(out_layouts);
    Py_XDECREF(grad_layouts);
    Py_XDECREF(in_layouts);
    Py_XDECREF(key);
    Py_XDECREF(parts);
    Py_XDECREF(mesh);
    return res;
}

/* _under_disabled_torch_function(func, args, kwargs, grad): called by torch._C._disabled_torch_function_impl, so
   it answers in Python objects: the result, or dispatcher._NOT_HANDLED. In grad mode the replicated path first,
   then (either mode) the decision path's cache hit. */
static PyObject *twins_entry(PyObject *module, PyObject *const *argv, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "_under_disabled_torch_function(func, args, kwargs, grad)");
        return NULL;
    }
    int grad = (argv[3] == Py_True);
    PyObject *res = grad ? replicated_local_grad(argv[0], argv[1], argv[2]) : NOT_HANDLED;
    if (res == NOT_HANDLED) res = decision_hit(argv[0], argv[1], argv[2], grad);
    if (res == NOT_HANDLED) {
        Py_INCREF(not_handled_obj);
        return not_handled_obj;
    }
    return res;
}

/* The twins above, run inside _disabled_torch_function_impl (as the Python path runs inside
   DisableTorchFunctionSubclass): a new reference, NOT_HANDLED, or NULL. */
static PyObject *under_disabled(PyObject *func, PyObject *types, PyObject *args, PyObject *kwargs, int grad) {
    PyObject *inner = PyTuple_Pack(4, func, args, kwargs, grad ? Py_True : Py_False);
    if (inner == NULL) return NULL;
    PyObject *call[3] = {grad_entry, types, inner};
    PyObject *res = PyObject_Vectorcall(disabled_impl, call, 3, NULL);
    Py_DECREF(inner);
    if (res == not_handled_obj) {
        Py_DECREF(res);
        return NOT_HANDLED;
    }
    return res;
}

/* __torch_function__(func, types, args=(), kwargs=None), installed as a staticmethod. */
static PyObject *torch_function(PyObject *module, PyObject *const *argv, Py_ssize_t nargs, PyObject *kwnames) {
    if (python_path == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "hyper_parallel._fastpath used before configure()");
        return NULL;
    }
    if (kwnames == NULL && nargs >= 3) {
        PyObject *func = argv[0], *kwargs = nargs >= 4 ? argv[3] : Py_None;
        PyObject *inplace = PyDict_GetItemWithError(fast_funcs, func);  /* borrowed: Py_True for in-place ops */
        if (inplace != NULL) {
            PyObject *g = PyObject_CallNoArgs(grad_enabled);
            if (g == NULL) return NULL;
            int grad = (g == Py_True);
            Py_DECREF(g);
            PyObject *res = NOT_HANDLED;
            if (!grad) {
                res = replicated_local(func, argv[2], kwargs == Py_None ? NULL : kwargs, inplace);
                if (res == NOT_HANDLED && inplace == Py_False && grad_entry != NULL)
                    res = under_disabled(func, argv[1], argv[2], kwargs, 0);
            } else if (inplace == Py_False && grad_entry != NULL) {
                res = under_disabled(func, argv[1], argv[2], kwargs, 1);
                if (res == NOT_HANDLED)  /* declined before running anything: the general path, not this again */
                    return PyObject_Vectorcall(grad_declined, argv, nargs, kwnames);
            }
            if (res != NOT_HANDLED) return res;
        } else if (PyErr_Occurred()) {
            PyErr_Clear();  /* unhashable funcs are simply not fast */
        } else if (passthrough != NULL) {
            int meta = PySet_Contains(passthrough, func);
            if (meta < 0) PyErr_Clear();
            else if (meta)  /* the wrapper's own metadata; kwargs=None is not a mapping to torch's impl: leave it out */
                return PyObject_Vectorcall(disabled_impl, argv, nargs >= 4 && argv[3] == Py_None ? 3 : nargs, NULL);
        }
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

/* The configure_* functions: keep a reference to each of `vals` in the matching static of `slots`. */
static PyObject *keep_all(PyObject **slots[], PyObject *vals[], int n) {
    for (int i = 0; i < n; i++) {
        Py_INCREF(vals[i]);
        Py_XSETREF(*slots[i], vals[i]);
    }
    Py_RETURN_NONE;
}

static PyObject *configure_grad(PyObject *module, PyObject *args) {
    PyObject *pt, *di, *li, *wl, *nv, *gd, *ge, *nh, *ed;
    if (!PyArg_ParseTuple(args, "O!OOOOOOOO!:configure_grad", &PySet_Type, &pt, &di, &li, &wl, &nv, &gd, &ge, &nh,
                          &PyDict_Type, &ed))
        return NULL;
    PyObject **slots[] = {&passthrough, &disabled_impl, &local_input_fn, &wrap_local_fn, &note_view_fn,
                          &grad_declined, &grad_entry, &not_handled_obj, &empty_dict};
    PyObject *vals[] = {pt, di, li, wl, nv, gd, ge, nh, ed};
    return keep_all(slots, vals, 9);
}

static PyObject *configure_decision(PyObject *module, PyObject *args) {
    PyObject *ro, *dc, *rc, *wo, *lr, *tr;
    if (!PyArg_ParseTuple(args, "O!O!O!OO!O:configure_decision", &PyDict_Type, &ro, &PyDict_Type, &dc, &PyList_Type,
                          &rc, &wo, &PyType_Type, &lr, &tr))
        return NULL;
    PyObject **slots[] = {&rule_of, &decisions, &recorders, &wrap_outs_fn, (PyObject **)&local_reshape_type,
                          &tensor_reshape};
    PyObject *vals[] = {ro, dc, rc, wo, lr, tr};
    for (int i = 0; i < 6; i++) {
        Py_INCREF(vals[i]);
        Py_XSETREF(*slots[i], vals[i]);
    }
    if (find_slot(&reshape_shape, local_reshape_type) < 0) return NULL;
    Py_RETURN_NONE;
}

/* ---- the autograd bridge's nodes in C (dtensor/autograd.py: Wrap, Unwrap, wrap_local, local_input) ----------
   Why: a training step makes one Wrap node per op output and one Unwrap node per parameter use. torch runs their
   forward and backward as Python calls (plus BackwardCFunction.apply's own Python frame), which on a tiny model
   cost more than the op. These are the same functions written in C, for the common cases only: a layout change
   (a redistribution) or a gradient that must be moved is handed to the Python functions, which stay the
   reference (autograd.use_c_nodes switches between the two; the tests run both). The nodes keep the same
   attributes on their ctx in both versions. */
static PyObject *wrap_apply;          /* torch's C _FunctionBase.apply bound to autograd.Wrap */
static PyObject *unwrap_apply;        /* ... bound to autograd.Unwrap */
static PyObject *functorch_active;    /* torch._C._are_functorch_transforms_active */
static PyObject *wrap_local_py;       /* autograd.wrap_local: under functorch transforms (Function.apply's preamble) */
static PyObject *local_input_py;      /* autograd.local_input: likewise */
static PyObject *local_grad_py;       /* autograd.local_grad(grad, layout): a gradient that must be moved */
static PyObject *unwrap_forward_py;   /* the Python Unwrap.forward(ctx, ...): an input that must be redistributed */
static PyObject *unwrap_backward_py;  /* the Python Unwrap.backward(ctx, grad): a gradient that must be moved */
static PyObject *size_type;           /* torch.Size, the type of every wrapper's _shape */
static PyObject *s_layout, *s_src, *s_grad_layout, *s_is_leaf, *s_has_partial, *s_detach, *s_grad_fn;

/* make_dtensor(local, layout, shape): a new wrapper around `local` (borrowed arguments; new reference). */
static PyObject *new_dtensor(PyObject *local, PyObject *layout, PyObject *shape) {
    PyObject *size = shape, *res = NULL;
    if (Py_TYPE(shape) == (PyTypeObject *)size_type) Py_INCREF(size);
    else if ((size = PyObject_CallOneArg(size_type, shape)) == NULL) return NULL;
    PyObject *dtype = PyObject_GetAttr(local, s_dtype), *device = PyObject_GetAttr(local, s_device);
    if (dtype != NULL && device != NULL) {
        PyObject *argv[8] = {(PyObject *)dtensor_type, size, Py_None, Py_None, Py_None, dtype, strided, device};
        res = PyObject_Vectorcall(make_wrapper, argv, 8, NULL);
        if (res != NULL && (set_slot(res, &dt_local, local) < 0 || set_slot(res, &dt_layout, layout) < 0 ||
                            set_slot(res, &dt_shape, size) < 0))
            Py_CLEAR(res);
    }
    Py_XDECREF(dtype);
    Py_XDECREF(device);
    Py_DECREF(size);
    return res;
}

/* 1 if functorch transforms are active (Function.apply's Python preamble must run), 0, -1 on error. */
static int under_functorch(void) {
    PyObject *r = PyObject_CallNoArgs(functorch_active);
    if (r == NULL) return -1;
    int yes = (r == Py_True);
    Py_DECREF(r);
    return yes;
}

/* The layout a gradient must have to be handed to a tensor of `layout` (autograd.grad_target) when that is
   `layout` itself: 1; 0 when it has a pending reduction (the Python functions move it); -1 on error. */
static int is_own_grad_target(PyObject *layout) {
    return attr_is(layout, s_has_partial, Py_False);
}

/* Wrap.forward(ctx, local, layout, shape) */
static PyObject *wrap_forward(PyObject *module, PyObject *const *argv, Py_ssize_t nargs) {
    if (nargs != 4) { PyErr_SetString(PyExc_TypeError, "Wrap.forward(ctx, local, layout, shape)"); return NULL; }
    if (PyObject_SetAttr(argv[0], s_layout, argv[2]) < 0) return NULL;
    return new_dtensor(argv[1], argv[2], argv[3]);
}

/* Wrap.backward(ctx, grad) -> (local gradient, None, None) */
static PyObject *wrap_backward(PyObject *module, PyObject *const *argv, Py_ssize_t nargs) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "Wrap.backward(ctx, grad)"); return NULL; }
    PyObject *grad = argv[1], *g = NULL;
    PyObject *layout = PyObject_GetAttr(argv[0], s_layout);
    if (layout == NULL) return NULL;
    int own = 0;
    if (Py_TYPE(grad) == dtensor_type) {
        own = is_own_grad_target(layout);
        if (own > 0) {
            PyObject *gl = get_slot(grad, &dt_layout);
            if (gl == NULL) own = -1;
            else { own = (gl == layout); Py_DECREF(gl); }
        }
    }
    if (own > 0) g = get_slot(grad, &dt_local);
    else if (own == 0) g = PyObject_CallFunctionObjArgs(local_grad_py, grad, layout, NULL);
    Py_DECREF(layout);
    if (g == NULL) return NULL;
    PyObject *res = PyTuple_Pack(3, g, Py_None, Py_None);
    Py_DECREF(g);
    return res;
}

/* Unwrap.forward(ctx, dt, target, grad_layout, is_leaf) */
static PyObject *unwrap_forward(PyObject *module, PyObject *const *argv, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "Unwrap.forward(ctx, dt, target, grad_layout, is_leaf)");
        return NULL;
    }
    PyObject *ctx = argv[0], *dt = argv[1], *res = NULL;
    PyObject *src = get_slot(dt, &dt_layout);
    if (src == NULL) return NULL;
    if (src != argv[2]) {  /* a redistribution: the Python function */
        Py_DECREF(src);
        return PyObject_Vectorcall(unwrap_forward_py, argv, nargs, NULL);
    }
    PyObject *shape = get_slot(dt, &dt_shape), *local = NULL;
    if (shape != NULL && PyObject_SetAttr(ctx, s_src, src) == 0 && PyObject_SetAttr(ctx, s_shape, shape) == 0 &&
        PyObject_SetAttr(ctx, s_grad_layout, argv[3]) == 0 && PyObject_SetAttr(ctx, s_is_leaf, argv[4]) == 0 &&
        (local = get_slot(dt, &dt_local)) != NULL)
        res = PyObject_CallMethodNoArgs(local, s_detach);
    Py_XDECREF(local);
    Py_XDECREF(shape);
    Py_DECREF(src);
    return res;
}

/* Unwrap.backward(ctx, grad) -> (DTensor gradient, None, None, None) */
static PyObject *unwrap_backward(PyObject *module, PyObject *const *argv, Py_ssize_t nargs) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "Unwrap.backward(ctx, grad)"); return NULL; }
    PyObject *ctx = argv[0], *res = NULL, *src = NULL, *shape = NULL, *dt = NULL;
    PyObject *glay = PyObject_GetAttr(ctx, s_grad_layout), *leaf = PyObject_GetAttr(ctx, s_is_leaf);
    if (glay == NULL || leaf == NULL) goto done;
    int moves = 0;
    if (PyObject_IsTrue(leaf)) {  /* a leaf takes its gradient in its own layout (without pending sums) */
        if ((src = PyObject_GetAttr(ctx, s_src)) == NULL) goto done;
        int own = is_own_grad_target(src);
        if (own < 0) goto done;
        moves = !own || src != glay;
    }
    if (moves || Py_TYPE(argv[1]) != (PyTypeObject *)tensor_type) {
        res = PyObject_Vectorcall(unwrap_backward_py, argv, nargs, NULL);
        goto done;
    }
    if ((shape = PyObject_GetAttr(ctx, s_shape)) == NULL) goto done;
    if ((dt = new_dtensor(argv[1], glay, shape)) == NULL) goto done;
    res = PyTuple_Pack(4, dt, Py_None, Py_None, Py_None);
done:
    Py_XDECREF(dt);
    Py_XDECREF(shape);
    Py_XDECREF(src);
    Py_XDECREF(leaf);
    Py_XDECREF(glay);
    return res;
}

/* autograd.wrap_local(local, layout, shape): Wrap through torch's C apply (Function.apply's preamble only does
   something under functorch transforms). */
static PyObject *wrap_local_c(PyObject *module, PyObject *const *argv, Py_ssize_t nargs) {
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "wrap_local(local, layout, shape)"); return NULL; }
    int f = under_functorch();
    if (f < 0) return NULL;
    return PyObject_Vectorcall(f ? wrap_local_py : wrap_apply, argv, 3, NULL);
}

/* autograd.local_input(t, target, grad_layout): the local itself in the identity case, else an Unwrap node. */
static PyObject *local_input_c(PyObject *module, PyObject *const *argv, Py_ssize_t nargs) {
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "local_input(t, target, grad_layout)"); return NULL; }
    PyObject *t = argv[0];
    if (Py_TYPE(t) != dtensor_type) return PyObject_Vectorcall(local_input_py, argv, 3, NULL);
    PyObject *local = get_slot(t, &dt_local);
    if (local == NULL) return NULL;
    if (argv[1] == argv[2]) {
        PyObject *layout = get_slot(t, &dt_layout);
        if (layout == NULL) { Py_DECREF(local); return NULL; }
        int same = (layout == argv[1]);
        Py_DECREF(layout);
        if (same) {
            int rg = wrapper_requires_grad(local);
            if (rg < 0) { Py_DECREF(local); return NULL; }
            if (rg) return local;
        }
    }
    Py_DECREF(local);
    int f = under_functorch();
    if (f < 0) return NULL;
    if (f) return PyObject_Vectorcall(local_input_py, argv, 3, NULL);
    PyObject *gf = PyObject_GetAttr(t, s_grad_fn);
    if (gf == NULL) return NULL;
    PyObject *call[4] = {t, argv[1], argv[2], gf == Py_None ? Py_True : Py_False};
    Py_DECREF(gf);
    return PyObject_Vectorcall(unwrap_apply, call, 4, NULL);
}

/* DTensor.__torch_dispatch__(func, types, args, kwargs): the autograd engine's own aten calls on wrappers. The one
   of every training step, aten.detach of each parameter's gradient as AccumulateGrad stores it (and aten.alias),
   is answered here: the same wrapper around the detached local, as engine_ops._alias makes; every other op goes
   to engine_ops.engine_dispatch. */
static PyObject *engine_dispatch_py;  /* engine_ops.engine_dispatch(func, args, kwargs) */
static PyObject *aten_detach, *aten_alias;

static PyObject *torch_dispatch(PyObject *module, PyObject *const *argv, Py_ssize_t nargs) {
    if (nargs < 3) { PyErr_SetString(PyExc_TypeError, "__torch_dispatch__(func, types, args, kwargs=None)"); return NULL; }
    PyObject *func = argv[0], *args = argv[2], *kwargs = nargs > 3 ? argv[3] : Py_None;
    if ((func == aten_detach || func == aten_alias) && PyTuple_Check(args) && PyTuple_GET_SIZE(args) == 1 &&
        Py_TYPE(PyTuple_GET_ITEM(args, 0)) == dtensor_type && (kwargs == Py_None ||
                                                                (PyDict_Check(kwargs) && PyDict_GET_SIZE(kwargs) == 0))) {
        PyObject *x = PyTuple_GET_ITEM(args, 0), *res = NULL;
        PyObject *local = get_slot(x, &dt_local), *layout = get_slot(x, &dt_layout), *shape = get_slot(x, &dt_shape);
        if (local != NULL && layout != NULL && shape != NULL) {
            /* the Tensor method, not the OpOverload (whose __call__ is a Python frame): the same aten op */
            PyObject *out = func == aten_detach ? PyObject_CallMethodNoArgs(local, s_detach) : PyObject_CallOneArg(func, local);
            if (out != NULL) {
                res = new_dtensor(out, layout, shape);
                Py_DECREF(out);
            }
        }
        Py_XDECREF(local);
        Py_XDECREF(layout);
        Py_XDECREF(shape);
        return res;
    }
    PyObject *kw = kwargs;
    if (kwargs == Py_None && (kw = PyDict_New()) == NULL) return NULL;
    else if (kwargs != Py_None) Py_INCREF(kw);
    PyObject *res = PyObject_CallFunctionObjArgs(engine_dispatch_py, func, args, kw, NULL);
    Py_DECREF(kw);
    return res;
}

static PyObject *configure_engine(PyObject *module, PyObject *args) {
    PyObject *ed, *dt, *al;
    if (!PyArg_ParseTuple(args, "OOO:configure_engine", &ed, &dt, &al)) return NULL;
    PyObject **slots[] = {&engine_dispatch_py, &aten_detach, &aten_alias};
    PyObject *vals[] = {ed, dt, al};
    return keep_all(slots, vals, 3);
}

/* as_method(f): f bound as a method of the instances of the class it is set on (PyInstanceMethod), so that
   torch's `ctx.apply(*grads)` calls a C backward with the ctx, as BackwardCFunction.apply would. */
static PyObject *as_method(PyObject *module, PyObject *f) {
    return PyInstanceMethod_New(f);
}

static PyObject *configure_nodes(PyObject *module, PyObject *args) {
    PyObject *wa, *ua, *fa, *wl, *li, *lg, *uf, *ub, *sz;
    if (!PyArg_ParseTuple(args, "OOOOOOOOO!:configure_nodes", &wa, &ua, &fa, &wl, &li, &lg, &uf, &ub, &PyType_Type, &sz))
        return NULL;
    PyObject **slots[] = {&wrap_apply, &unwrap_apply, &functorch_active, &wrap_local_py, &local_input_py,
                          &local_grad_py, &unwrap_forward_py, &unwrap_backward_py, &size_type};
    PyObject *vals[] = {wa, ua, fa, wl, li, lg, uf, ub, sz};
    return keep_all(slots, vals, 9);
}

static PyMethodDef methods[] = {
    {"torch_function", (PyCFunction)(void (*)(void))torch_function, METH_FASTCALL | METH_KEYWORDS,
     "DTensor.__torch_function__: the replicated no-grad path in C, everything else in Python."},
    {"configure", configure, METH_VARARGS, "Hand the module the Python objects it works with."},
    {"configure_grad", configure_grad, METH_VARARGS,
     "Switch on the grad-mode replicated path and the wrapper-metadata passthrough, with the objects they use."},
    {"_under_disabled_torch_function", (PyCFunction)(void (*)(void))twins_entry, METH_FASTCALL,
     "(func, args, kwargs, grad): the grad-mode replicated path, then the decision cache hit; torch function off."},
    {"configure_decision", configure_decision, METH_VARARGS,
     "Switch on the decision path's cache hit, with the dispatcher's tables and helpers."},
    {"configure_nodes", configure_nodes, METH_VARARGS,
     "Hand the autograd nodes' C versions the Python objects they use (torch's apply bound to Wrap/Unwrap, ...)."},
    {"wrap_forward", (PyCFunction)(void (*)(void))wrap_forward, METH_FASTCALL, "Wrap.forward(ctx, local, layout, shape)"},
    {"wrap_backward", (PyCFunction)(void (*)(void))wrap_backward, METH_FASTCALL, "Wrap.backward(ctx, grad)"},
    {"unwrap_forward", (PyCFunction)(void (*)(void))unwrap_forward, METH_FASTCALL,
     "Unwrap.forward(ctx, dt, target, grad_layout, is_leaf)"},
    {"unwrap_backward", (PyCFunction)(void (*)(void))unwrap_backward, METH_FASTCALL, "Unwrap.backward(ctx, grad)"},
    {"wrap_local", (PyCFunction)(void (*)(void))wrap_local_c, METH_FASTCALL, "autograd.wrap_local(local, layout, shape)"},
    {"local_input", (PyCFunction)(void (*)(void))local_input_c, METH_FASTCALL,
     "autograd.local_input(t, target, grad_layout)"},
    {"torch_dispatch", (PyCFunction)(void (*)(void))torch_dispatch, METH_FASTCALL,
     "DTensor.__torch_dispatch__: aten.detach/alias of a wrapper in C, every other engine op in engine_ops."},
    {"configure_engine", configure_engine, METH_VARARGS,
     "Hand torch_dispatch engine_ops.engine_dispatch and the aten ops it answers itself."},
    {"as_method", as_method, METH_O, "f as a method of the instances of the class it is set on (PyInstanceMethod)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_fastpath", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fastpath(void) {
    PyObject **names[] = {&dt_local.name, &dt_layout.name, &s_shape, &dt_shape.name, &layout_is_replicate.name,
                          &layout_mesh.name, &s_replicated_layouts, &s_dtype, &s_device, &s_view_of,
                          &s_requires_grad, &s_base, &s_float_args_matter, &s_in_layouts, &s_grad_layouts,
                          &s_out_layouts, &s_out_shapes, &s_local_fn, &s_layout, &s_src, &s_grad_layout, &s_is_leaf,
                          &s_has_partial, &s_detach, &s_grad_fn, &reshape_shape.name, &s_hp_copy};
    const char *texts[] = {"_local", "_layout", "shape", "_shape", "is_replicate", "mesh", "replicated_layouts",
                           "dtype", "device", "_view_of", "requires_grad", "_base",
                           "float_args_matter", "in_layouts", "grad_layouts", "out_layouts", "out_shapes", "local_fn",
                           "layout", "src", "grad_layout", "is_leaf", "has_partial", "detach", "grad_fn", "shape",
                           "_hp_copy"};
    for (int i = 0; i < 27; i++) {
        *names[i] = PyUnicode_InternFromString(texts[i]);
        if (*names[i] == NULL) return NULL;
    }
    return PyModule_Create(&moduledef);
}
