/* The credential scan's statistics of a token run, in one pass each
 * (services/policy/credentials.py; the pure Python there is the reference and the
 * fallback, and tests/unit/test_credentials.py checks that both agree).
 *
 * found() takes the whole text (and its lower-case form) as UTF-8 bytes and only
 * looks for ASCII literals in them; the statistics functions take token runs, which
 * are ASCII.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* counts(data) -> list[int]: how often each byte occurs, in order of first occurrence
 * (the order of collections.Counter, so that the entropy sums the same floats). */
static PyObject *
counts(PyObject *module, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *data = view.buf;
    Py_ssize_t n = view.len, count[256] = {0};
    unsigned char order[256];
    int distinct = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (count[data[i]]++ == 0)
            order[distinct++] = data[i];
    }
    PyBuffer_Release(&view);
    PyObject *out = PyList_New(distinct);
    if (out == NULL)
        return NULL;
    for (int k = 0; k < distinct; k++) {
        PyObject *value = PyLong_FromSsize_t(count[order[k]]);
        if (value == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, k, value);
    }
    return out;
}

enum { OTHER, DIGIT, LOWER, UPPER };

static int
class_of(unsigned char c)
{
    if (c >= '0' && c <= '9')
        return DIGIT;
    if (c >= 'a' && c <= 'z')
        return LOWER;
    if (c >= 'A' && c <= 'Z')
        return UPPER;
    return OTHER;
}

/* words(data) -> (letters and digits, words): the words are the matches of
 * [A-Z]?[a-z]+|[A-Z]+(?![a-z])|[0-9]+, which cover every letter and digit; one
 * starts at a digit after a non-digit, a lower-case letter after a non-letter, a
 * capital after a non-capital, and the last capital of a run lower-case follows. */
static PyObject *
words(PyObject *module, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *data = view.buf;
    Py_ssize_t n = view.len, letters = 0, starts = 0;
    int previous = OTHER;
    for (Py_ssize_t i = 0; i < n; i++) {
        int current = class_of(data[i]);
        if (current != OTHER)
            letters++;
        if (current == DIGIT && previous != DIGIT)
            starts++;
        else if (current == LOWER && previous != LOWER && previous != UPPER)
            starts++;
        else if (current == UPPER) {
            if (previous != UPPER)
                starts++;
            else if (i + 1 < n && class_of(data[i + 1]) == LOWER)
                starts++;
        }
        previous = current;
    }
    PyBuffer_Release(&view);
    return Py_BuildValue("(nn)", letters, starts);
}

/* steps(data) -> int: the positions whose next byte is this one plus one. */
static PyObject *
steps(PyObject *module, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *data = view.buf;
    Py_ssize_t n = view.len, found = 0;
    for (Py_ssize_t i = 0; i + 1 < n; i++)
        found += data[i + 1] == data[i] + 1;
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(found);
}

/* found(data, needles) -> int: bit k set when needles[k] (bytes, at most 64 of them)
 * occurs in data; one pass, whatever the number of needles. */
static PyObject *
found(PyObject *module, PyObject *args)
{
    Py_buffer view;
    PyObject *needles;
    if (!PyArg_ParseTuple(args, "y*O!", &view, &PyTuple_Type, &needles))
        return NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(needles);
    if (count > 64) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "at most 64 needles");
        return NULL;
    }
    const char *text[64];
    Py_ssize_t length[64];
    /* the needles a position may start, by its byte and by the byte after it */
    unsigned long long by_first[256] = {0}, by_second[256] = {0}, single = 0, all = 0, seen = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        PyObject *needle = PyTuple_GET_ITEM(needles, k);
        if (!PyBytes_Check(needle) || PyBytes_GET_SIZE(needle) == 0) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_TypeError, "needles are non-empty bytes");
            return NULL;
        }
        text[k] = PyBytes_AS_STRING(needle);
        length[k] = PyBytes_GET_SIZE(needle);
        by_first[(unsigned char)text[k][0]] |= 1ULL << k;
        if (length[k] == 1)
            single |= 1ULL << k;
        else
            by_second[(unsigned char)text[k][1]] |= 1ULL << k;
        all |= 1ULL << k;
    }
    for (int b = 0; b < 256; b++)
        by_second[b] |= single;
    const unsigned char *data = view.buf;
    Py_ssize_t n = view.len;
    for (Py_ssize_t i = 0; i < n && seen != all; i++) {
        unsigned long long candidates =
            by_first[data[i]] & (i + 1 < n ? by_second[data[i + 1]] : single) & ~seen;
        while (candidates) {
            int k = __builtin_ctzll(candidates);
            candidates &= candidates - 1;
            if (length[k] <= n - i && memcmp(data + i, text[k], (size_t)length[k]) == 0)
                seen |= 1ULL << k;
        }
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(seen);
}

static PyMethodDef methods[] = {
    {"found", found, METH_VARARGS, "Bit k set when needles[k] occurs in data."},
    {"counts", counts, METH_O, "Byte counts in order of first occurrence."},
    {"words", words, METH_O, "(letters and digits, word starts) of ASCII text."},
    {"steps", steps, METH_O, "Positions whose next byte is this one plus one."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_textstats", "The credential scan's statistics, in C.", -1, methods,
};

PyMODINIT_FUNC
PyInit__textstats(void)
{
    return PyModule_Create(&module);
}
