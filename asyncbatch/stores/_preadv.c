/* Many positional reads into one buffer, with the GIL released for all of them.
 *
 * read_many(fds, offsets, lengths, dest, dest_offsets) -> (done, got, errno)
 *   fds: int32 buffer; offsets, lengths, dest_offsets: int64 buffers, one entry per read;
 *   dest: a writable buffer. Read i copies lengths[i] bytes at offsets[i] of fds[i] to
 *   dest[dest_offsets[i]:]. Every destination range is checked to lie inside dest before
 *   any read starts. Returns done == number of reads on success; otherwise read `done`
 *   stopped after `got` bytes, with `errno` set (0 for end of file).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <unistd.h>

static int get_array(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *name,
                     int writable) {
    if (PyObject_GetBuffer(obj, view, (writable ? PyBUF_WRITABLE : PyBUF_SIMPLE)) < 0) {
        return -1;
    }
    if (itemsize > 1 && view->len % itemsize != 0) {
        PyErr_Format(PyExc_ValueError, "%s: buffer size is not a multiple of %zd", name, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *read_many(PyObject *self, PyObject *args) {
    PyObject *fds_obj, *offsets_obj, *lengths_obj, *dest_obj, *dest_offsets_obj;
    if (!PyArg_ParseTuple(args, "OOOOO", &fds_obj, &offsets_obj, &lengths_obj, &dest_obj,
                          &dest_offsets_obj)) {
        return NULL;
    }
    Py_buffer fds = {0}, offsets = {0}, lengths = {0}, dest = {0}, dest_offsets = {0};
    PyObject *result = NULL;
    if (get_array(fds_obj, &fds, 4, "fds", 0) < 0) goto done;
    if (get_array(offsets_obj, &offsets, 8, "offsets", 0) < 0) goto done;
    if (get_array(lengths_obj, &lengths, 8, "lengths", 0) < 0) goto done;
    if (get_array(dest_obj, &dest, 1, "dest", 1) < 0) goto done;
    if (get_array(dest_offsets_obj, &dest_offsets, 8, "dest_offsets", 0) < 0) goto done;

    Py_ssize_t count = fds.len / 4;
    if (offsets.len / 8 != count || lengths.len / 8 != count || dest_offsets.len / 8 != count) {
        PyErr_SetString(PyExc_ValueError, "fds, offsets, lengths, dest_offsets differ in length");
        goto done;
    }
    const int32_t *fd = (const int32_t *)fds.buf;
    const int64_t *offset = (const int64_t *)offsets.buf;
    const int64_t *length = (const int64_t *)lengths.buf;
    const int64_t *at = (const int64_t *)dest_offsets.buf;
    char *out = (char *)dest.buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (offset[i] < 0 || length[i] < 0 || at[i] < 0 || at[i] > dest.len ||
            length[i] > dest.len - at[i]) {
            PyErr_Format(PyExc_ValueError, "read %zd: range outside the buffers", i);
            goto done;
        }
    }

    Py_ssize_t i = 0;
    int64_t got = 0;
    int error = 0;
    Py_BEGIN_ALLOW_THREADS
    for (; i < count; i++) {
        got = 0;
        while (got < length[i]) {
            ssize_t n = pread(fd[i], out + at[i] + got, (size_t)(length[i] - got), offset[i] + got);
            if (n > 0) {
                got += n;
            } else if (n == 0) {
                break; /* end of file: a short read */
            } else if (errno != EINTR) {
                error = errno;
                break;
            }
        }
        if (got < length[i]) break;
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("nLi", i, (long long)got, error);

done:
    if (fds.obj) PyBuffer_Release(&fds);
    if (offsets.obj) PyBuffer_Release(&offsets);
    if (lengths.obj) PyBuffer_Release(&lengths);
    if (dest.obj) PyBuffer_Release(&dest);
    if (dest_offsets.obj) PyBuffer_Release(&dest_offsets);
    return result;
}

static PyMethodDef methods[] = {
    {"read_many", read_many, METH_VARARGS,
     "read_many(fds, offsets, lengths, dest, dest_offsets) -> (done, got, errno)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_preadv", NULL, -1, methods};

PyMODINIT_FUNC PyInit__preadv(void) { return PyModule_Create(&module); }
